"""Experiment trackers: where a run's metrics go besides its CSV (TensorBoard, Weights & Biases).

`MetricsLogger` fans every row out to the trackers of its `Tracking`; a process that forwards
rows another file already holds (the trainer's per-run rows, held-out evaluations) calls
`MetricsLogger.track`, so each run has one set of trackers, opened by the one process that owns
the run (its orchestrator, or the classic runner), and one W&B run per rlplex run.

```
[logging]                 # in a main job (every run gets it) or a `rlplex train` file
tensorboard = true        # event files: <job folder>/tb/<run> (main job), else <log dir>/tb
wandb = false             # one W&B run per rlplex run, grouped by the job's name
wandb_project = "rlplex"
wandb_mode = "offline"    # WANDB_MODE in the environment wins; `wandb sync` uploads later
print_every_s = 30        # main job without the live view: a line per run this often
```

The trackers are imported when opened, never at module import: a run without W&B never
imports it (2 s), and TensorBoard loads only where it is written.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.errors import ConfigError
from rlplex.io.safe_files import make_real_dir

WANDB_PIN = "wandb==0.31.0"


class LoggingConfig(StrictModel):
    """`[logging]`: the trackers a run's metrics go to, and the headless progress lines."""

    tensorboard: bool = Field(True, description="TensorBoard event files of every metric")
    wandb: bool = Field(False, description="a Weights & Biases run per rlplex run (needs the wandb package)")
    wandb_project: str = Field("rlplex", min_length=1, description="the W&B project of the runs")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="no network unless asked; the WANDB_MODE environment variable wins"
    )
    wandb_group: str | None = Field(None, description="W&B group; a main job sets its name")
    print_every_s: float = Field(30.0, gt=0, description="main job without the live view: seconds between lines")


class Tracker(Protocol):
    """A sink of metric rows. Steps of one namespace rise; different namespaces may interleave."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """One W&B run. Each row carries its step as the `step` metric, the x axis of every chart:
    W&B's own step must only rise, and a run's orchestrator logs rollout step N before the
    trainer's row of step N - 1 reaches it."""

    def __init__(self, settings: LoggingConfig, directory: Path, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        group = settings.wandb_group
        self._run = wandb.init(
            project=settings.wandb_project,
            group=group,
            name=name,
            # The same id after a restart: `wandb sync` joins the pieces into one run.
            id=_wandb_id(f"{group}-{name}" if group else name),
            resume="allow",
            dir=str(directory),
            mode=os.environ.get("WANDB_MODE") or settings.wandb_mode,  # type: ignore[arg-type]
            config=dict(config),
            reinit="create_new",  # several runs in one process (tests, a script training two)
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({"step": step, **metrics})

    def close(self) -> None:
        self._run.finish()


def _wandb_id(text: str) -> str:
    # W&B ids may not hold '/', ':' or spaces; a job's name may.
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:128]


@dataclass(frozen=True)
class Tracking:
    """What opens a run's trackers: the settings, the run's name and its config (W&B logs it).
    Plain data, so that a runner built in another process can carry it."""

    settings: LoggingConfig = field(default_factory=LoggingConfig)
    name: str = "run"
    config: Mapping[str, Any] = field(default_factory=dict)
    directory: Path | None = None
    """Where the trackers write, for all runs of a job: `<directory>/tb/<name>` and
    `<directory>/wandb`; None: the run's log folder (`<log dir>/tb`, `<log dir>/wandb`)."""

    def open(self, log_dir: Path, tensorboard: bool = True) -> list[Tracker]:
        """The trackers asked for, each ready; `tensorboard` False leaves TensorBoard out."""
        base = self.directory
        if self.settings.wandb and importlib.util.find_spec("wandb") is None:  # before any file is made
            raise ConfigError(f"logging.wandb = true needs the wandb package: pip install {WANDB_PIN}")
        trackers: list[Tracker] = []
        try:
            if tensorboard and self.settings.tensorboard:
                if base is None:
                    trackers.append(TensorBoardTracker(make_real_dir(log_dir / "tb")))
                else:
                    trackers.append(TensorBoardTracker(make_real_dir(make_real_dir(base / "tb") / self.name)))
            if self.settings.wandb:
                trackers.append(WandbTracker(self.settings, base or log_dir, self.name, self.config))
        except BaseException:
            close_all(trackers)
            raise
        return trackers


def finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """The finite values of a row: a NaN or inf point (an empty evaluation, say) draws nothing."""
    return {key: float(value) for key, value in metrics.items() if math.isfinite(float(value))}


def close_all(trackers: list[Tracker]) -> None:
    """Close each tracker; one that fails does not keep the others open."""
    errors = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as error:  # a tracker's own failure, re-raised after the others closed
            errors.append(error)
    trackers.clear()
    if errors:
        raise errors[0]


__all__ = ["LoggingConfig", "TensorBoardTracker", "Tracker", "Tracking", "WandbTracker", "close_all", "finite"]
