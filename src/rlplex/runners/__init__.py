"""Runners: the training loops of seed 002 (MinibatchRl, SyncRl, AsyncRl and their Eval variants)."""

from rlplex.runners.async_ import AsyncRl, AsyncRlEval
from rlplex.runners.minibatch import MinibatchRl, MinibatchRlEval, TrainResult
from rlplex.runners.sync import SyncLauncher, SyncRl, SyncRlEval

__all__ = [
    "AsyncRl",
    "AsyncRlEval",
    "MinibatchRl",
    "MinibatchRlEval",
    "SyncLauncher",
    "SyncRl",
    "SyncRlEval",
    "TrainResult",
]
