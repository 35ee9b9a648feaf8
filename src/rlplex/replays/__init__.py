"""Replay buffers for off-policy algorithms (in ordinary or shared memory)."""

from rlplex.replays.uniform import ReplayHandle, UniformReplayBuffer

__all__ = ["ReplayHandle", "UniformReplayBuffer"]
