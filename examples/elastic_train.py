"""A plain torch.distributed training script, as run by torchrun or by rlplex's ElasticWorker.

It reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, trains a small MLP with DDP (gloo) on a
synthetic regression task (y = sin(x . w)), checkpoints every `--ckpt-every` steps (rank 0
writes, atomically: a temporary file renamed over the old one), resumes from the last
checkpoint, and after `--steps` steps writes a result file. It knows nothing of rlplex except
two optional environment variables: RLPLEX_CHECKPOINT_DIR (default ./checkpoints) and
RLPLEX_PROGRESS_FILE (a JSON object of numbers, rewritten every step).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/elastic_train.py --steps 50
    rlplex job run examples/elastic_job.toml
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_DIM = 8


def write_atomic(path: Path, data: Any) -> None:
    """Write to a temporary file, then rename: readers see the old file or the new one, never half of one.
    A dict of tensors goes through torch.save, anything else as JSON."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, dict) and "model" in data:
        torch.save(data, tmp)
    else:
        tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank): a resumed run sees the data it would have seen."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, IN_DIM, generator=gen)
    w = torch.linspace(-1.0, 1.0, IN_DIM)
    return x, torch.sin(x @ w).unsqueeze(1)


def leave(store: dist.Store, rank: int, world: int) -> None:
    """Leave the group with rank 0 last. Rank 0 serves the store: if it exits while a peer is still
    tearing down its side of the group, that peer can abort (SIGABRT) instead of exiting 0, and
    an elastic launcher then counts a failure after a finished run."""
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        store.wait([f"left/{peer}" for peer in range(1, world)], timedelta(seconds=30))
    else:
        store.set(f"left/{rank}", "1")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step (demos, tests)")
    parser.add_argument("--result", default=None, help="default: <checkpoint dir>/result.json")
    args = parser.parse_args(argv)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500))
    ckpt_dir = Path(os.environ.get("RLPLEX_CHECKPOINT_DIR", "checkpoints"))
    progress_file = os.environ.get("RLPLEX_PROGRESS_FILE")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, result_path = ckpt_dir / "last.pt", Path(args.result or ckpt_dir / "result.json")

    torch.set_num_threads(1)
    # The rendezvous store, explicit so that the shutdown below can still use it. Rank 0 serves it,
    # unless the launcher does (torchrun's agent store, rlplex's ElasticWorker): then all are clients.
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(addr, port, world, serves, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(IN_DIM, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if ckpt_path.exists():
        # Our own file, written below: tensors and numbers only (weights_only refuses anything else).
        state = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    resumed_from = step
    print(f"rank {rank}/{world}: start at step {step} (restart {os.environ.get('RLPLEX_RESTART_COUNT', 0)})",
          flush=True)  # fmt: skip
    ddp = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        x, y = batch(step, rank, args.batch)
        optimizer.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and step % args.ckpt_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            write_atomic(ckpt_path, state)
        if progress_file:
            info = {"step": step, "loss": float(loss.item()), "resumed_from": resumed_from}
            write_atomic(Path(progress_file), info)
        if args.step_delay:
            time.sleep(args.step_delay)

    with torch.no_grad():
        x, y = batch(10**6, 0, 512)  # a held-out batch, the same on every rank
        final = loss_fn(model(x), y).reshape(1)
    dist.all_reduce(final)
    final_loss = float(final.item()) / world
    if rank == 0:
        result = {"steps": step, "final_loss": final_loss, "world": world, "resumed_from": resumed_from,
                  "restarts": int(os.environ.get("RLPLEX_RESTART_COUNT", 0))}  # fmt: skip
        write_atomic(result_path, result)
        print(f"done: {result}", flush=True)
    leave(store, rank, world)


if __name__ == "__main__":
    main()
