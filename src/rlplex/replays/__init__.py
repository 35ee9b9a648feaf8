"""Replay buffers for off-policy algorithms (in ordinary or shared memory)."""

from typing import Any

from rlplex.replays.prioritized import PrioritizedReplayBuffer, SumTree
from rlplex.replays.sequence import SequenceReplayBuffer
from rlplex.replays.uniform import ReplayHandle, UniformReplayBuffer


def attach_replay(handle: ReplayHandle) -> Any:
    """The replay of `handle`, in a child process, as the class that made it."""
    if handle.kind == SequenceReplayBuffer.kind:
        return SequenceReplayBuffer.attach(handle)
    cls = PrioritizedReplayBuffer if handle.kind == PrioritizedReplayBuffer.kind else UniformReplayBuffer
    return cls.attach(handle)


__all__ = [
    "PrioritizedReplayBuffer",
    "ReplayHandle",
    "SequenceReplayBuffer",
    "SumTree",
    "UniformReplayBuffer",
    "attach_replay",
]
