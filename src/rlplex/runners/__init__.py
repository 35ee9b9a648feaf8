"""Runners: the training loops of seed 002 (MinibatchRl, SyncRl, AsyncRl and their Eval variants)."""

from rlplex.runners.async_ import AsyncRl, AsyncRlEval
from rlplex.runners.minibatch import MinibatchRl, MinibatchRlEval, TrainResult

__all__ = ["AsyncRl", "AsyncRlEval", "MinibatchRl", "MinibatchRlEval", "TrainResult"]
