"""The control plane: places, starts, watches and heals the processes of a job (seed 003)."""

# --- DataChannel (worker self-loop) ---
from rlplex.control.channel import ChannelClosedError, ChannelError, ChannelTimeoutError, DataChannel
from rlplex.control.channel_local import LocalDataChannel
from rlplex.control.channel_ray import RayDataChannel
from rlplex.control.selfloop import SelfLoopStats, run_self_loop

# --- end DataChannel ---

__all__ = [
    # DataChannel (worker self-loop)
    "ChannelClosedError",
    "ChannelError",
    "ChannelTimeoutError",
    "DataChannel",
    "LocalDataChannel",
    "RayDataChannel",
    "SelfLoopStats",
    "run_self_loop",
]
