"""Samplers collect experience: serial, parallel CPU workers, and asynchronous (double buffer)."""

from rlplex.samplers.base import Evaluator, Sampler
from rlplex.samplers.batch import SampleBatch, allocate_batch
from rlplex.samplers.parallel import ParallelSampler
from rlplex.samplers.serial import SerialSampler

__all__ = ["Evaluator", "ParallelSampler", "SampleBatch", "Sampler", "SerialSampler", "allocate_batch"]
