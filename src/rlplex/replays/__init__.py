"""Replay buffers for off-policy algorithms (in ordinary or shared memory)."""

from rlplex.replays.prioritized import PrioritizedReplayBuffer, SumTree
from rlplex.replays.uniform import ReplayHandle, UniformReplayBuffer


def attach_replay(handle: ReplayHandle) -> UniformReplayBuffer:
    """The replay of `handle`, in a child process, as the class that made it."""
    cls = PrioritizedReplayBuffer if handle.kind == PrioritizedReplayBuffer.kind else UniformReplayBuffer
    return cls.attach(handle)


__all__ = ["PrioritizedReplayBuffer", "ReplayHandle", "SumTree", "UniformReplayBuffer", "attach_replay"]
