"""Samplers collect experience: serial, parallel CPU workers, and asynchronous (double buffer)."""

from rlplex.samplers.base import Evaluator, Sampler
from rlplex.samplers.batch import SampleBatch, allocate_batch
from rlplex.samplers.parallel import ParallelSampler
from rlplex.samplers.serial import SerialSampler

from rlplex.samplers.async_ import AsyncSampler  # isort: skip  (after batch: agents import it)

__all__ = [
    "AsyncSampler",
    "Evaluator",
    "ParallelSampler",
    "SampleBatch",
    "Sampler",
    "SerialSampler",
    "allocate_batch",
]
