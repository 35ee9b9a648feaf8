"""`python -m rlplex.multirun.trainer`: parse the flags, join the torchrun-style gloo group
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment), run `MultiRunTrainer`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from rlplex.config import validate_config
from rlplex.models.spec import ModelSpec
from rlplex.multirun.trainer import MultiRunTrainer, TrainerConfig

log = logging.getLogger("rlplex.multirun.trainer")


def _init_distributed() -> bool:
    import os
    from datetime import timedelta

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return False
    dist.init_process_group(
        "gloo",
        rank=int(os.environ["RANK"]),
        world_size=world,
        init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}",
        timeout=timedelta(seconds=float(os.environ.get("RLPLEX_DIST_TIMEOUT_S", "300"))),
    )
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlplex.multirun.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--max-runs", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--model", default=None, help="the shared base model: a hub id or local folder")
    parser.add_argument(
        "--model-json", default=None, help="the whole [model] table as JSON (ModelSpec); overrides --model"
    )
    parser.add_argument("--steps", type=int, default=None, help="stop after N iterations that trained")
    parser.add_argument("--until-idle", type=float, default=None, help="stop after S seconds with nothing to train")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    import json

    if not (args.model or args.model_json):
        parser.error("give the shared base model: --model NAME or --model-json JSON")
    model_data = json.loads(args.model_json) if args.model_json else {"name": args.model}
    model = validate_config(ModelSpec, model_data, source="--model-json")
    config = TrainerConfig(
        output_dir=args.output_dir,
        max_runs=args.max_runs,
        max_lora_rank=args.max_lora_rank,
        micro_tokens=args.micro_tokens,
        micro_batches=args.micro_batches,
        checkpoint_every=args.checkpoint_every,
        model=model,
    )
    owns_group = _init_distributed()
    try:
        trainer = MultiRunTrainer(config)
        trainer.install_signal_handlers()
        worked = trainer.run(steps=args.steps, until_idle_s=args.until_idle)
        log.info("trainer rank %d: stopped after %d training iterations", trainer.rank, worked)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0
