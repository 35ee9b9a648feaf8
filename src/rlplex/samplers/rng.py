"""Random-generator state as plain JSON values, so that a resumed run continues its streams.

Two kinds of stream exist in sampling: a process's global generators (torch, numpy, Python's
`random`: the agents' action sampling and exploration noise) and each environment's own
`np_random` (initial states at every reset). Both are captured here as JSON-able values
(ints, strings, lists) that travel in a snapshot's JSON and between processes without pickle.

An environment's state cannot be saved (gymnasium has no portable state), so a resumed run
starts new episodes; but with its generator restored, the first reset draws what the
uninterrupted run's next reset would have drawn, rather than repeating the run's first seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rlplex.errors import SnapshotError
from rlplex.io.snapshot import set_cuda_rng_states

JsonState = dict[str, Any]


def process_rng_state() -> JsonState:
    """The calling process's torch, numpy and Python global generator states."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, py_gauss = random.getstate()
    state: JsonState = {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": [str(name), np.asarray(keys, dtype=np.uint32).tobytes().hex(), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(internal), py_gauss],
    }
    if torch.cuda.is_initialized():  # a model on a GPU draws its actions there
        state["torch_cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def set_process_rng_state(state: JsonState) -> None:
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(state["torch"])), dtype=torch.uint8))
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.frombuffer(bytes.fromhex(keys), dtype=np.uint32).copy(), pos, has_gauss, gauss))
        version, internal, py_gauss = state["python"]
        random.setstate((version, tuple(internal), py_gauss))
        cuda = [torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8) for s in state.get("torch_cuda", [])]
        set_cuda_rng_states(cuda)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise SnapshotError(f"malformed random generator state in snapshot: {error}") from None


def env_rng_state(env: gym.Env[Any, Any]) -> JsonState | None:
    """The environment's `np_random` state; None before its first seeded reset."""
    inner = env.unwrapped
    if getattr(inner, "_np_random", None) is None:
        return None
    state = inner.np_random.bit_generator.state
    return json.loads(json.dumps(state))  # ints of any size and strings: JSON as it is


def set_env_rng_state(env: gym.Env[Any, Any], state: JsonState) -> None:
    try:
        bit_generator = getattr(np.random, state["bit_generator"])()
        bit_generator.state = state
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise SnapshotError(f"malformed environment generator state in snapshot: {error}") from None
    env.unwrapped.np_random = np.random.Generator(bit_generator)


def fit_env_states(states: Sequence[Any], n_envs: int, rank: int) -> list[Any]:
    """`states` for `n_envs` environments. A snapshot of another layout (e.g. one process with
    4 environments resumed as 2 ranks with 2 each) has no state for each environment: each then
    gets a new seed (an int) derived from all the snapshot's states, so that no environment
    repeats the episodes that an environment of the earlier run started from its seed."""
    if len(states) == n_envs:
        return list(states)
    entropy = int(streams_digest(list(states))[:16], 16)
    sequence = np.random.SeedSequence(entropy=entropy, spawn_key=(rank,))
    return [int(s) for s in sequence.generate_state(n_envs, dtype=np.uint32)]


def streams_digest(process_states: Sequence[JsonState | None]) -> str:
    """SHA-256 of process generator states: equal digests mean equal streams from here on."""
    return hashlib.sha256(json.dumps(list(process_states), sort_keys=True).encode()).hexdigest()
