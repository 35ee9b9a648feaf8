"""The trainer's entry points: `run_trainer(config)`, the function every trainer rank runs (through
`rlplex.control.elastic.entry`, which has joined the round's process group), and the standalone
`python -m rlplex.multirun.trainer`, whose flags build the same `TrainerConfig`:

- run as it is, it is a local control-plane job (`job.run_trainer_job`): `--nproc` ranks under an
  ElasticMaster, restarted when they die (`--max-restarts`), rank 0's log on its output, its
  state under `rlplex job status <output-dir>/trainer_job`; SIGTERM / Ctrl-C stops it gracefully;
- run as one rank of a group someone else launched (torchrun: RANK in the environment), it joins
  that gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) the same way and calls
  `run_trainer`; torchrun is then its supervisor.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rlplex.config import validate_config
from rlplex.control.elastic.entry import install_stop_handlers, join_group, leave_group
from rlplex.errors import ConfigError
from rlplex.models.spec import ModelSpec
from rlplex.multirun.trainer.config import TrainerConfig
from rlplex.multirun.trainer.job import run_trainer_job

log = logging.getLogger("rlplex.multirun.trainer")


def run_trainer(config: TrainerConfig) -> int:
    """Train until stopped (SIGTERM / SIGINT: the graceful stop) or `config.steps` / `until_idle_s`."""
    # Torch and the trainer here, not at import: the job file's check imports this module to
    # read `run_trainer`'s config model, in the master's process.
    import torch

    from rlplex.multirun.trainer.loop import MultiRunTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_stop_handlers()  # first: a stop asked while the model loads is kept
    if config.threads:
        torch.set_num_threads(config.threads)
    trainer = MultiRunTrainer(config)
    trainer.install_signal_handlers()
    worked = trainer.run(steps=config.steps, until_idle_s=config.until_idle_s)
    log.info("trainer rank %d: stopped after %d training iterations", trainer.rank, worked)
    return 0


def parse_args(argv: list[str] | None = None) -> tuple[TrainerConfig, argparse.Namespace]:
    """The standalone trainer's flags: the `TrainerConfig` the main job would give it, and the
    job's own flags (`nproc`, `max_restarts`)."""
    parser = argparse.ArgumentParser(prog="python -m rlplex.multirun.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--max-runs", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--micro-tokens", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--max-off-policy-steps", type=int, default=None)
    parser.add_argument("--model", default=None, help="the shared base model: a hub id or local folder")
    parser.add_argument(
        "--model-json", default=None, help="the whole [model] table as JSON (ModelSpec); overrides --model"
    )
    parser.add_argument("--steps", type=int, default=None, help="stop after N iterations that trained")
    parser.add_argument("--until-idle", type=float, default=None, help="stop after S seconds with nothing to train")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=1, help="ranks of the trainer's job (not under torchrun)")
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of the trainer's ranks before its job fails"
    )
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.max_restarts < 0:
        parser.error(
            f"--nproc must be at least 1 and --max-restarts at least 0 (got {args.nproc}, {args.max_restarts})"
        )
    if not (args.model or args.model_json):
        parser.error("give the shared base model: --model NAME or --model-json JSON")
    model_data = json.loads(args.model_json) if args.model_json else {"name": args.model}
    data = {
        "output_dir": args.output_dir,
        "max_runs": args.max_runs,
        "max_lora_rank": args.max_lora_rank,
        "micro_tokens": args.micro_tokens,
        "micro_batches": args.micro_batches,
        "checkpoint_every": args.checkpoint_every,
        "model": validate_config(ModelSpec, model_data, source="--model-json"),
        "steps": args.steps,
        "until_idle_s": args.until_idle,
        "threads": args.threads,
    }
    if args.max_off_policy_steps is not None:
        data["max_off_policy_steps"] = args.max_off_policy_steps
    return validate_config(TrainerConfig, data, source="python -m rlplex.multirun.trainer"), args


def main(argv: list[str] | None = None) -> int:
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        install_stop_handlers()  # first: a stop asked while the flags are read is kept
    try:
        config, args = parse_args(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not under_torchrun:
        try:
            return run_trainer_job(config, args.nproc, args.max_restarts)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    owns_group = join_group()
    try:
        return run_trainer(config)
    finally:
        if owns_group:
            leave_group()
