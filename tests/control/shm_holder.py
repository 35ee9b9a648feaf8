"""A process that creates every kind of process-owned shared memory, prints the names and holds
them until killed (the tests of rlplex.io.shm_reaper run it in a process group of its own)."""

from __future__ import annotations

import json
import multiprocessing
import sys
from multiprocessing import shared_memory

import numpy as np
import torch

from rlplex.samplers.shared_arrays import SharedArrays
from rlplex.samplers.weights import SharedWeights

if __name__ == "__main__":
    arrays = SharedArrays.create({"x": ((1024,), np.float32)})
    weights = SharedWeights.create({"w": torch.zeros(4)})
    lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, as the async sampler's
    plain = shared_memory.SharedMemory(create=True, size=4096)  # as a library (vLLM) makes them
    names = [name for _, name, _, _ in arrays.handle.arrays] + [weights.handle.segment, plain.name]
    names.append("sem." + lock._semlock.name.lstrip("/"))  # type: ignore[attr-defined]
    print(json.dumps({"names": names, "handle": arrays.handle.arrays}), flush=True)
    sys.stdin.read()  # until the test closes our stdin or kills us
