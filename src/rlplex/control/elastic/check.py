"""The node check run by each `ElasticWorker` before it trains, as its own process:

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m rlplex.control.elastic.check --size 256

It joins a gloo (or nccl) group with the other members, all-reduces a tensor of ones (the sum must be the
world size), times a few matmuls, and prints one JSON line: {"ok", "allreduce_s", "matmul_s",
"error"}. Torch is imported here only, never by the control plane.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def run_check(size: int, timeout_s: float, backend: str = "gloo") -> dict[str, Any]:
    """In the group that torchrun's environment describes (see `join_group`)."""
    import torch
    import torch.distributed as dist

    from rlplex.control.elastic.entry import join_group

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            return {"ok": False, "error": "backend nccl needs CUDA, and torch.cuda.is_available() is False here"}
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    join_group(backend, timeout_s, alone=True)
    try:
        ones = torch.ones(1024, device=device)
        t1 = time.perf_counter()
        dist.all_reduce(ones)
        sync()
        allreduce_s = time.perf_counter() - t1
        if not torch.all(ones == world):
            return {"ok": False, "error": f"all-reduce gave {ones[0].item()} instead of {world}"}
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(rank)).to(device)
        torch.mm(a, a)  # warm-up
        sync()
        t2 = time.perf_counter()
        for _ in range(4):
            b = torch.mm(a, a)
        sync()
        matmul_s = (time.perf_counter() - t2) / 4
        if not torch.isfinite(b).all():
            return {"ok": False, "error": "matmul produced non-finite values"}
        dist.barrier()
        return {"ok": True, "allreduce_s": allreduce_s, "matmul_s": matmul_s, "init_s": t1 - t0}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlplex.control.elastic.check")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = parser.parse_args(argv)
    try:
        result = run_check(args.size, args.timeout_s, args.backend)
    except Exception as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
