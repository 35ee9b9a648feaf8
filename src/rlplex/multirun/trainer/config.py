"""`TrainerConfig`: everything the multi-run trainer needs, as one model (torch-free, so that the
main job builds it and the job file's check validates it without importing the trainer).

It crosses into the trainer's process once, as its JSON: the main job puts it in the trainer
role's config (`rlplex.control.elastic.entry` rebuilds it there for `run_trainer`), and the standalone
`python -m rlplex.multirun.trainer` builds the same model from its flags.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir.retention import RetentionConfig

CLIP_EPS = 0.2


class TrainerConfig(StrictModel):
    output_dir: Path
    max_runs: int = Field(ge=1)
    max_lora_rank: int = Field(8, ge=1)
    target_modules: tuple[str, ...] | None = Field(
        None, description="Layers that get LoRA adapters (last name component); None = the model family's default."
    )
    micro_tokens: int = Field(4096, ge=1, description="Row tokens per micro-batch (padded width x rows).")
    micro_batches: int = Field(4, ge=1, description="Micro-batches per rank per iteration.")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint a run every N of its steps (and at its last).")
    model: ModelSpec = Field(description="The shared frozen base model; every run must name the same one.")
    clip_eps: float = Field(CLIP_EPS, gt=0)
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="How many step folders of each run stay on disk (checkpoints, broadcast, consumed rollouts).",
    )
    max_off_policy_steps: int = Field(
        8,
        ge=0,
        description="Rollouts generated more than this many steps before the step they train are dropped; "
        "a run whose max_async_level is higher is rejected.",
    )
    poll_interval_s: float = Field(0.05, gt=0)
    output_retry_s: float = Field(
        5.0,
        gt=0,
        description="Seconds before a run's checkpoint, broadcast or finished marker that failed is tried again.",
    )
    max_output_failures: int = Field(
        12,
        ge=1,
        description="A run whose checkpoint or broadcast failed this many attempts in a row is evicted with the error "
        "(with output_retry_s 5: a disk full for a minute).",
    )
    # How long `run_trainer` goes on (None: until stopped: SIGTERM, SIGINT, or the control plane's stop).
    steps: int | None = Field(None, ge=0, description="Stop after this many iterations that trained something.")
    until_idle_s: float | None = Field(None, gt=0, description="Stop after this many seconds with nothing to train.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of this process (None: torch's default).")
