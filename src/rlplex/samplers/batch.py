"""The sample batch: fixed, importable array fields of shape [T, B, ...].

A fixed dataclass (not a type made at run time, as rlpyt's namedarraytuples were) so that
it pickles under `spawn` and can be laid over shared memory for worker processes.

`next_observation[t, b]` is the observation that followed step t: at an episode's end it is
the final observation, before the reset. That lets PPO bootstrap through time-limit
truncations and lets DQN store exact transitions, without a separate "last observation".
`completed_return[t, b]` / `completed_length[t, b]` hold an episode's totals at the step it
ended and NaN / 0 elsewhere, so episode statistics travel inside the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from rlplex.agents.base import InfoSpec
from rlplex.envs import EnvSpaces

__all__ = ["ARRAY_FIELDS", "InfoSpec", "SampleBatch", "allocate_batch", "batch_from_arrays", "batch_layout"]

ARRAY_FIELDS = (
    "observation",
    "action",
    "reward",
    "terminated",
    "truncated",
    "next_observation",
    "completed_return",
    "completed_length",
)


@dataclass
class SampleBatch:
    observation: np.ndarray  # [T, B, *obs_shape] float32, or uint8 for images
    action: np.ndarray  # [T, B] int64 or [T, B, *act_shape] float32
    reward: np.ndarray  # [T, B] float32
    terminated: np.ndarray  # [T, B] bool
    truncated: np.ndarray  # [T, B] bool
    next_observation: np.ndarray  # [T, B, *obs_shape] as observation
    completed_return: np.ndarray  # [T, B] float32, NaN where no episode ended
    completed_length: np.ndarray  # [T, B] int64, 0 where no episode ended
    agent_info: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. log_prob [T, B], value [T, B]

    @property
    def T(self) -> int:
        return int(self.reward.shape[0])

    @property
    def B(self) -> int:
        return int(self.reward.shape[1])

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in ARRAY_FIELDS:
            yield name, getattr(self, name)
        for name, value in self.agent_info.items():
            yield f"agent_info.{name}", value

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> SampleBatch:
        return SampleBatch(
            **{f.name: fn(getattr(self, f.name)) for f in fields(self) if f.name != "agent_info"},
            agent_info={k: fn(v) for k, v in self.agent_info.items()},
        )

    def env_slice(self, start: int, stop: int) -> SampleBatch:
        """A view of environments [start, stop) (no copy)."""
        return self.map(lambda a: a[:, start:stop])

    def copy(self) -> SampleBatch:
        return self.map(np.copy)

    def episode_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns and lengths of the episodes that ended in this batch."""
        done = self.completed_length > 0
        return self.completed_return[done], self.completed_length[done]


def batch_layout(spaces: EnvSpaces, info_spec: InfoSpec, T: int, B: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Shapes and dtypes of every array of a [T, B] batch, keyed as in `SampleBatch.arrays()`."""
    layout: dict[str, tuple[tuple[int, ...], Any]] = {
        "observation": ((T, B, *spaces.obs_shape), spaces.obs_dtype),
        "action": ((T, B, *spaces.action_shape), spaces.action_dtype),
        "reward": ((T, B), np.float32),
        "terminated": ((T, B), np.bool_),
        "truncated": ((T, B), np.bool_),
        "next_observation": ((T, B, *spaces.obs_shape), spaces.obs_dtype),
        "completed_return": ((T, B), np.float32),
        "completed_length": ((T, B), np.int64),
    }
    for name, (shape, dtype) in info_spec.items():
        layout[f"agent_info.{name}"] = ((T, B, *shape), dtype)
    return layout


def batch_from_arrays(arrays: dict[str, np.ndarray]) -> SampleBatch:
    info = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("agent_info.")}
    return SampleBatch(**{name: arrays[name] for name in ARRAY_FIELDS}, agent_info=info)


def allocate_batch(spaces: EnvSpaces, info_spec: InfoSpec, T: int, B: int) -> SampleBatch:
    """A zeroed batch in ordinary memory."""
    return batch_from_arrays(
        {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in batch_layout(spaces, info_spec, T, B).items()}
    )
