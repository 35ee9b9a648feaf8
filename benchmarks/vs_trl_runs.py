"""What both sides of `benchmarks.vs_trl` train: a run's settings, the presets (tiny and
SmolLM2), the main job rlplex runs, and the GRPOTrainer and LoRA arguments TRL gets. Imported by
the benchmark, by its TRL worker process (`vs_trl_worker`) and by the test that both sides get
the same run; no torch, no trl."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlplex.config import StrictModel, read_toml, toml_key, toml_value, validate_config
from rlplex.mainjob.config import MainJobConfig
from rlplex.multirun.orchestrator.config import OptimConfig
from rlplex.multirun.trainer.config import CLIP_EPS

ROOT = Path(__file__).resolve().parents[1]
DEMO_JOB = ROOT / "examples" / "smollm2_arithmetic.toml"
INSTALL_HINT = "trl is not installed; install the benchmark dependencies: pip install -r requirements-bench.txt"
COMMAND_TIMEOUT_S = 4 * 3600.0
MICRO_BATCH_TOKENS = 4096  # the trainer's micro-batch, as in the SmolLM2 demo
ASYNC_LEVEL = 1  # the main job's default: generation of step s+1 overlaps training of step s
# The tiny checkpoint of benchmarks.multirun_learning's arithmetic preset: a 2..7 times table,
# half learnt in its supervised warm-up, so RL has something to gain.
TINY_TASK: dict[str, Any] = {"name": "arithmetic", "max_operand": 7, "operations": ["multiply"]}
TINY_WARMUP_STEPS = 125


class RunSettings(StrictModel):
    """One RL run, as both sides get it."""

    run_id: str
    model: str
    env: dict[str, Any]
    prompts: int  # per step
    group_size: int
    max_new_tokens: int
    lora_rank: int
    lora_alpha: float
    lr: float
    temperature: float = 1.0
    steps: int
    seed: int

    @property
    def batch_size(self) -> int:
        """Completions per step: rlplex's `batch_size`."""
        return self.prompts * self.group_size


class TrlJob(StrictModel):
    """What one TRL process is given (as JSON, on its command line)."""

    run: RunSettings
    threads: int
    micro_batch: int  # rows per forward/backward; the step's batch is accumulated over them
    output_dir: str


@dataclass(frozen=True)
class Preset:
    """A model's task and budget."""

    label: str
    env: dict[str, Any]
    prompts: int
    group_size: int
    max_new_tokens: int
    lora_rank: int
    lora_alpha: float
    lr: float  # case A
    lrs: tuple[float, float, float]  # case B
    seeds: tuple[int, int, int]
    steps_a: int
    steps_b: int
    heldout_examples: int
    temperatures: tuple[float, ...]  # of the held-out evaluations
    trl_threads: int
    trl_micro_rows: int  # rows of one TRL forward/backward (the step's batch is accumulated)


def tiny_preset() -> Preset:
    """The tiny checkpoint on its times table: 16 prompts x 8, 16 new tokens, LoRA rank 8."""
    return Preset(
        label="tiny",
        env={**TINY_TASK, "heldout_fraction": 0.2, "split": "train"},
        prompts=16,
        group_size=8,
        max_new_tokens=16,
        lora_rank=8,
        lora_alpha=16.0,
        lr=3e-3,
        lrs=(1e-3, 3e-3, 5e-3),
        seeds=(1, 2, 3),
        steps_a=60,
        steps_b=30,
        heldout_examples=64,
        temperatures=(0.0, 1.0),
        # Measured on 2 shared cores, 60 steps: TRL took 120 s with 1 thread, 851 s with 2.
        trl_threads=1,
        trl_micro_rows=32,  # about the 4096 tokens of rlplex's micro-batch
    )


def smollm2_preset() -> Preset:
    """`make demo-real`'s runs (examples/smollm2_arithmetic.toml): its task, batch, LoRA and rates."""
    runs = [entry["config"] for entry in read_toml(DEMO_JOB)["runs"]]
    first = runs[0]
    lrs = tuple(run["optim"]["lr"] for run in runs)
    seeds = tuple(run["seed"] for run in runs)
    assert len(lrs) == 3 and len(seeds) == 3, f"{DEMO_JOB} holds three runs"
    return Preset(
        label="smollm2",
        env=dict(first["env"]),
        prompts=first["batch_size"] // first["group_size"],
        group_size=first["group_size"],
        max_new_tokens=first["env"]["max_new_tokens"],
        lora_rank=first["model"]["lora"]["rank"],
        lora_alpha=first["model"]["lora"]["alpha"],
        lr=lrs[1],
        lrs=(lrs[0], lrs[1], lrs[2]),
        seeds=(seeds[0], seeds[1], seeds[2]),
        steps_a=30,
        steps_b=30,
        heldout_examples=first["evaluation"]["examples"],
        temperatures=tuple(first["evaluation"]["temperatures"]),
        # Measured on 2 shared cores, 3 steps: TRL took 285 s with 1 thread, 492 s with 2.
        trl_threads=1,
        # 32 rows (rlplex's 4096 tokens) peaked at 14 GB RSS: three TRL processes at once would
        # not fit in 23 GB. 8 rows (one group) keeps each to a third of that.
        trl_micro_rows=8,
    )


def preset_for(model: str) -> Preset:
    """tiny, or SmolLM2's settings for smollm2 and any other model folder."""
    return tiny_preset() if model == "tiny" else smollm2_preset()


def case_runs(preset: Preset, model_dir: str, case: str, steps: int) -> list[RunSettings]:
    """Case A: one run at the preset's rate; case B: three, one per rate (and seed)."""
    rates = [(preset.lr, preset.seeds[1])] if case == "A" else list(zip(preset.lrs, preset.seeds, strict=True))
    return [
        RunSettings(
            run_id=f"run_lr{lr:g}",
            model=model_dir,
            env=preset.env,
            prompts=preset.prompts,
            group_size=preset.group_size,
            max_new_tokens=preset.max_new_tokens,
            lora_rank=preset.lora_rank,
            lora_alpha=preset.lora_alpha,
            lr=lr,
            steps=steps,
            seed=seed,
        )
        for lr, seed in rates
    ]


# --- rlplex's side ----------------------------------------------------------------------------


def rlplex_run_entry(run: RunSettings) -> dict[str, Any]:
    """The run's `[[runs]]` entry of the main job."""
    return {
        "id": run.run_id,
        "config": {
            "env": run.env,
            "seed": run.seed,
            "max_steps": run.steps,
            "batch_size": run.batch_size,
            "group_size": run.group_size,
            "max_new_tokens": run.max_new_tokens,
            "temperature": run.temperature,
            "max_async_level": ASYNC_LEVEL,
            "model": {"lora": {"rank": run.lora_rank, "alpha": run.lora_alpha}},
            "optim": {"lr": run.lr},
        },
    }


def rlplex_job_data(runs: Sequence[RunSettings], output_dir: Path, name: str) -> dict[str, Any]:
    """The main job file's contents: every run on one trainer rank, rollouts generated in process."""
    steps = max(run.steps for run in runs)
    return {
        "name": name,
        "output_dir": str(output_dir),
        "backend": "local",
        "timeout_s": COMMAND_TIMEOUT_S,
        "model": {"name": runs[0].model},
        "inference": {"engine": "hf"},
        "trainer": {
            "world_size": 1,
            "max_runs": len(runs),
            "max_lora_rank": max(run.lora_rank for run in runs),
            "micro_batch_tokens": MICRO_BATCH_TOKENS,
            # Only the last step's checkpoint, as TRL saves only its final adapter.
            "checkpoint_every": steps,
        },
        "runs": [rlplex_run_entry(run) for run in runs],
    }


def rlplex_job(runs: Sequence[RunSettings], output_dir: Path, name: str) -> MainJobConfig:
    return validate_config(MainJobConfig, rlplex_job_data(runs, output_dir, name), source=f"benchmark job {name}")


def job_toml(data: dict[str, Any]) -> str:
    """The main job file `rlplex run` reads (TOML has no null: None fields are left out)."""
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in data.items() if v is not None)


# --- TRL's side -------------------------------------------------------------------------------


def trl_micro_batch(run: RunSettings, rows: int) -> int:
    """Rows per TRL forward/backward: `rows`, or the largest whole share of the batch below it."""
    return max(d for d in range(1, min(rows, run.batch_size) + 1) if run.batch_size % d == 0)


def trl_arguments(job: TrlJob) -> dict[str, Any]:
    """`trl.GRPOConfig`'s arguments for the run. The optimizer and its schedule are rlplex's,
    given to the trainer ready-made (`vs_trl_worker`), so the rate and clipping are set here."""
    run = job.run
    optim = OptimConfig(lr=run.lr)
    return {
        "output_dir": job.output_dir,
        "use_cpu": True,
        "bf16": False,  # GRPOConfig's default is True; rlplex trains in float32 on the CPU
        "fp16": False,
        "seed": run.seed,
        "max_steps": run.steps,
        "learning_rate": optim.lr,
        "weight_decay": optim.weight_decay,
        "max_grad_norm": optim.max_grad_norm,
        # One generation of the whole step, one optimizer step over it, in micro-batches.
        "per_device_train_batch_size": job.micro_batch,
        "gradient_accumulation_steps": run.batch_size // job.micro_batch,
        "num_generations": run.group_size,
        "num_iterations": 1,
        "max_completion_length": run.max_new_tokens,
        "temperature": run.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "epsilon": CLIP_EPS,
        "loss_type": "dapo",  # token-level, normalised by the step's tokens: rlplex's 1 / N_k
        "scale_rewards": "group",
        "shuffle_dataset": False,  # the dataset is rlplex's draws, step after step
        "gradient_checkpointing": False,  # GRPOConfig's default is True: slower, for memory rlplex does not save
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def lora_arguments(run: RunSettings) -> dict[str, Any]:
    """`peft.LoraConfig`'s arguments but the target modules (rlplex's defaults for the model)."""
    return {"r": run.lora_rank, "lora_alpha": run.lora_alpha, "lora_dropout": 0.0, "bias": "none"}
