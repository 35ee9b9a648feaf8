"""Model function calls (MFCs) and the graph they form.

An MFC names a model, an interface call on it, the keys it reads and the keys it writes,
and how many sequences it takes per call. The graph is derived from key overlap: an MFC
depends on the MFC that produces each of its input keys; keys that no MFC produces must
come from the dataset. Everything that would otherwise fail at step 100 fails here, when
the graph is built, with the MFC and the key named.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from rlplex.errors import RlplexError


class GraphError(RlplexError):
    """The MFC graph is malformed (a cycle, an unknown key, two producers of one key)."""


class MFCExecutionError(RlplexError):
    """An MFC failed on a worker, or a worker returned outputs that break the MFC's contract."""


class ModelInterfaceType(StrEnum):
    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


@dataclass(frozen=True)
class MFCDef:
    name: str
    model_name: str
    interface_type: ModelInterfaceType
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...] = ()
    n_seqs: int = 1  # sequences per call

    def __post_init__(self) -> None:
        if self.n_seqs < 1:
            raise GraphError(f"MFC {self.name!r}: n_seqs must be at least 1 (got {self.n_seqs})")
        if not self.input_keys:
            raise GraphError(f"MFC {self.name!r}: needs at least one input key")


@dataclass(frozen=True)
class MFCGraph:
    mfcs: tuple[MFCDef, ...]  # in topological order
    dataset_keys: tuple[str, ...]
    producer: dict[str, str]  # key -> name of the MFC that writes it
    parents: dict[str, tuple[str, ...]]  # MFC name -> MFCs it waits on
    children: dict[str, tuple[str, ...]]

    def get(self, name: str) -> MFCDef:
        for mfc in self.mfcs:
            if mfc.name == name:
                return mfc
        raise GraphError(f"no MFC named {name!r}; known: {[m.name for m in self.mfcs]}")

    @property
    def final_mfcs(self) -> tuple[MFCDef, ...]:
        """MFCs nothing else waits on: a step is done when they are."""
        return tuple(m for m in self.mfcs if not self.children[m.name])

    @property
    def all_keys(self) -> tuple[str, ...]:
        keys = list(self.dataset_keys)
        for mfc in self.mfcs:
            keys.extend(k for k in mfc.output_keys if k not in keys)
        return tuple(keys)


def build_graph(mfcs: Sequence[MFCDef], dataset_keys: Iterable[str]) -> MFCGraph:
    dataset = tuple(dict.fromkeys(dataset_keys))
    names = [m.name for m in mfcs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise GraphError(f"MFC names must be unique; repeated: {sorted(duplicates)}")
    producer: dict[str, str] = {}
    for mfc in mfcs:
        for key in mfc.output_keys:
            if key in producer:
                raise GraphError(f"key {key!r} is produced by two MFCs: {producer[key]!r} and {mfc.name!r}")
            if key in dataset:
                raise GraphError(f"key {key!r} is produced by MFC {mfc.name!r} but also comes from the dataset")
            producer[key] = mfc.name
    parents: dict[str, tuple[str, ...]] = {}
    for mfc in mfcs:
        deps = []
        for key in mfc.input_keys:
            if key in producer:
                deps.append(producer[key])
            elif key not in dataset:
                raise GraphError(
                    f"MFC {mfc.name!r} reads key {key!r}, which no MFC produces and the dataset does not provide"
                )
        parents[mfc.name] = tuple(dict.fromkeys(deps))
    children = {m.name: tuple(c.name for c in mfcs if m.name in parents[c.name]) for m in mfcs}
    order = _topological_order(names, parents)
    by_name = {m.name: m for m in mfcs}
    return MFCGraph(tuple(by_name[n] for n in order), dataset, producer, parents, children)


def _topological_order(names: list[str], parents: dict[str, tuple[str, ...]]) -> list[str]:
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = [*path[path.index(name) :], name]
            raise GraphError(f"MFC graph has a cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for parent in parents[name]:
            visit(parent, [*path, name])
        state[name] = 2
        order.append(name)

    for name in names:
        visit(name, [])
    return order


def ppo_graph(batch_size: int = 16) -> MFCGraph:
    """The seed's synchronous PPO step: generate, reference and reward inference, train."""
    return build_graph(
        [
            MFCDef(
                "actor_gen",
                "actor",
                ModelInterfaceType.GENERATE,
                ("packed_prompts",),
                ("packed_input_ids", "packed_logprobs", "prompt_mask"),
                batch_size,
            ),
            MFCDef(
                "ref_inf",
                "ref",
                ModelInterfaceType.INFERENCE,
                ("packed_input_ids",),
                ("packed_ref_logprobs",),
                batch_size,
            ),
            MFCDef(
                "rew_inf",
                "reward",
                ModelInterfaceType.INFERENCE,
                ("packed_input_ids", "prompt_mask", "task_ids"),
                ("rewards",),
                batch_size,
            ),
            MFCDef(
                "actor_train",
                "actor",
                ModelInterfaceType.TRAIN_STEP,
                ("packed_input_ids", "packed_logprobs", "packed_ref_logprobs", "rewards", "prompt_mask"),
                (),
                batch_size,
            ),
        ],
        dataset_keys=("packed_prompts", "task_ids"),
    )


def grpo_graph(batch_size: int = 16) -> MFCGraph:
    """GRPO: no reference or critic model; rewards are compared within groups of one prompt."""
    return build_graph(
        [
            MFCDef(
                "actor_gen",
                "actor",
                ModelInterfaceType.GENERATE,
                ("packed_prompts",),
                ("packed_input_ids", "packed_logprobs", "prompt_mask"),
                batch_size,
            ),
            MFCDef(
                "rew_inf",
                "reward",
                ModelInterfaceType.INFERENCE,
                ("packed_input_ids", "prompt_mask", "task_ids"),
                ("rewards",),
                batch_size,
            ),
            MFCDef(
                "actor_train",
                "actor",
                ModelInterfaceType.TRAIN_STEP,
                ("packed_input_ids", "packed_logprobs", "rewards", "prompt_mask", "task_ids"),
                (),
                batch_size,
            ),
        ],
        dataset_keys=("packed_prompts", "task_ids"),
    )
