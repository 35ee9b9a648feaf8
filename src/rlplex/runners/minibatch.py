"""`MinibatchRl` and `MinibatchRlEval`: sample a batch, optimize, repeat, in one process.

The loop is the same for both; they differ only in what is logged as performance:
`MinibatchRl` the episodes completed in the online training samples, `MinibatchRlEval`
deterministic evaluation episodes run every log interval. `SyncRl` runs this same loop in
every rank; `AsyncRl` has its own loop because sampling happens elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlplex.agents.base import Agent
from rlplex.algos.base import Algo
from rlplex.diagnostics import MetricsLogger, ProgressLine
from rlplex.diagnostics.trackers import Tracking
from rlplex.errors import ConfigError, SnapshotError
from rlplex.io.snapshot import (
    SnapshotMode,
    algo_name,
    check_compatible,
    check_same_algo,
    read_snapshot,
    resumed_schedule_itrs,
    rng_state,
    save_by_mode,
    schedule_itrs,
    set_rng_state,
)
from rlplex.models import unwrap_model
from rlplex.models.device import resolve_device
from rlplex.runners.metrics import episode_metrics, evaluation_metrics
from rlplex.samplers.base import Evaluator, Sampler
from rlplex.samplers.rng import process_rng_state, streams_digest


@dataclass
class TrainResult:
    itr: int
    env_steps: int
    wall_time_s: float
    history: list[dict[str, float]] = field(default_factory=list)
    target_reached_at_steps: int | None = None
    target_reached_at_s: float | None = None


class MinibatchRl:
    """Train `agent` with `algo` on batches from `sampler` for `n_steps` environment steps.

    Batch sizes are per process: under `SyncRl` with world size W each rank samples
    `batch_T * batch_B` steps per iteration, so one iteration sees W times as many.
    `n_steps` counts steps over all ranks. Linear schedules (learning rate, clip range) run
    over `schedule_steps`, by default the `n_steps` of the run's first start: a resumed run
    with a larger `n_steps` keeps its schedules where they were (see `resumed_schedule_itrs`).

    `device` ("auto": CUDA when present, else the CPU) is where the agent's model, its
    training batches and the serial sampler's acting run; `startup` moves the model there.
    Sampler worker processes act on CPU copies whatever the device.
    """

    performance_source = "online"

    def __init__(
        self,
        algo: Algo,
        agent: Agent,
        sampler: Sampler,
        n_steps: int,
        seed: int = 0,
        log_interval_steps: int = 10_000,
        log_dir: str | Path | None = None,
        snapshot_mode: SnapshotMode = "last",
        snapshot_gap: int = 1,
        stop_at_return: float | None = None,
        show_progress: bool = True,
        rank: int = 0,
        world_size: int = 1,
        schedule_steps: int | None = None,
        device: str = "auto",
    ) -> None:
        if n_steps <= 0:
            raise ConfigError(f"field 'runner.n_steps': must be positive (got {n_steps})")
        self.algo = algo
        self.agent = agent
        self.sampler = sampler
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.itr_batch_size = sampler.batch_T * sampler.batch_B * world_size
        self.n_itr = max(1, -(-n_steps // self.itr_batch_size))
        self.schedule_itrs = schedule_itrs(schedule_steps, n_steps, self.itr_batch_size)
        self._schedule_given = schedule_steps is not None
        self.log_interval_itrs = max(1, log_interval_steps // self.itr_batch_size)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.snapshot_mode: SnapshotMode = snapshot_mode if self.log_dir is not None else "none"
        self.snapshot_gap = snapshot_gap
        self.stop_at_return = stop_at_return
        self.show_progress = show_progress and rank == 0
        self.start_itr = 0
        self._resume_state: dict[str, Any] | None = None
        # Told of every logged row, (env steps, metrics): how a supervised run's node reports progress.
        self.on_log_row: Callable[[int, Mapping[str, float]], None] | None = None
        self.tracking: Tracking | None = None  # `[logging]`'s trackers; None: TensorBoard in log_dir/tb
        self._elapsed_before_resume = 0.0
        self.final_streams_digest: str | None = None  # set by a train() that completes
        self.device = resolve_device(device, "runner.device", index=rank if world_size > 1 else None)

    # ----- setup and teardown -------------------------------------------------------------
    def startup(self) -> None:
        torch.manual_seed(self.seed + self.rank)
        np.random.seed((self.seed + self.rank) % 2**32)
        torch.set_num_threads(1)
        self._place_model()
        self.sampler.initialize(self.agent, seed=self.seed, rank=self.rank)
        self.algo.initialize(self.agent, n_itr=self.schedule_itrs, world_size=self.world_size)
        if self._resume_state is not None:
            self._load_resume_state(self._resume_state)
        resumed_at = None if self._resume_state is None else self.start_itr * self.itr_batch_size
        self.logger = (
            MetricsLogger(self.log_dir, resumed_at=resumed_at, on_row=self.on_log_row, tracking=self.tracking)
            if (self.log_dir is not None and self.rank == 0)
            else None
        )

    def _place_model(self) -> None:
        """Before the sampler copies the weights and the algorithm builds its optimizer."""
        if self.device.index is not None:
            torch.cuda.set_device(self.device)  # this rank's GPU for every later "cuda" tensor
        self.agent.model.to(self.device)

    def shutdown(self) -> None:
        self.sampler.shutdown()
        if getattr(self, "logger", None) is not None:
            self.logger.close()  # type: ignore[union-attr]

    # ----- snapshots ----------------------------------------------------------------------
    def _model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in unwrap_model(self.agent.model).state_dict().items()}

    def get_itr_snapshot(self, itr: int) -> dict[str, Any]:
        """Everything needed to continue this run after iteration `itr`."""
        return {
            "itr": itr,
            "env_steps": (itr + 1) * self.itr_batch_size,
            "elapsed_s": self._elapsed_before_resume + (time.perf_counter() - self._t0),
            "agent": self._model_state(),
            "algo": self.algo.state_dict(),
            "algo_name": algo_name(self.algo),
            "rng": rng_state(),
            "sampler": self.sampler.state_dict(),
            "seed": self.seed,
            "itr_batch_size": self.itr_batch_size,
            "schedule_itrs": self.schedule_itrs,
        }

    def save_itr_snapshot(self, itr: int) -> Path | None:
        if self.log_dir is None or self.rank != 0:
            return None
        return save_by_mode(
            self.log_dir / "snapshots", itr, self.get_itr_snapshot(itr), self.snapshot_mode, self.snapshot_gap
        )

    def resume_from(self, snapshot_dir: str | Path) -> None:
        """Continue a run from a snapshot directory (call before `train`)."""
        state = read_snapshot(snapshot_dir)
        check_same_algo(state, self.algo, snapshot_dir)
        state["__source__"] = str(snapshot_dir)
        if int(state["itr_batch_size"]) != self.itr_batch_size:
            raise SnapshotError(
                f"{snapshot_dir}: snapshot is from an incompatible config: {state['itr_batch_size']} samples per "
                f"iteration in the snapshot, {self.itr_batch_size} now (batch_T, batch_B or world size changed)"
            )
        self._resume_state = state
        self.schedule_itrs = resumed_schedule_itrs(state, self.schedule_itrs, self._schedule_given)
        self.start_itr = int(state["itr"]) + 1
        self._elapsed_before_resume = float(state["elapsed_s"])

    def _load_resume_state(self, state: dict[str, Any]) -> None:
        inner = unwrap_model(self.agent.model)
        check_compatible(inner.state_dict(), state["agent"], Path(state["__source__"]))
        inner.load_state_dict(state["agent"])
        try:
            self.algo.load_state_dict(state["algo"])
        except SnapshotError as error:
            raise SnapshotError(f"{state['__source__']}: {error}") from None
        try:
            self._load_streams(state)
        except SnapshotError as error:
            raise SnapshotError(f"{state['__source__']}: {error}") from None

    def _load_streams(self, state: dict[str, Any]) -> None:
        """Continue the run's random streams: this process's generators (action sampling and
        the algorithm's own draws) and the sampler's (its workers', its environments')."""
        set_rng_state(state["rng"])
        if "sampler" in state:  # older snapshots: environments restart from their seeds
            self.sampler.load_state_dict(state["sampler"])

    def streams_digest(self) -> str:
        """Digest of every generator whose use does not depend on the data (this process's and
        the sampler workers'; environments' are not: resets come when episodes end). After the
        same number of iterations, an uninterrupted and a resumed run have equal digests."""
        return streams_digest([process_rng_state(), *self.sampler.state_dict()["processes"]])

    # ----- the loop -----------------------------------------------------------------------
    def gather_episodes(self, returns: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Episode statistics of every rank (identity here; `SyncRl` gathers them to rank 0)."""
        return returns, lengths

    def evaluate_performance(self) -> dict[str, float]:
        return {}

    def train(self) -> TrainResult:
        self.startup()
        try:
            result = self._loop()
            self.final_streams_digest = self.streams_digest()
            return result
        finally:
            self.shutdown()

    def _loop(self) -> TrainResult:
        self._t0 = time.perf_counter()
        result = TrainResult(itr=self.start_itr, env_steps=self.start_itr * self.itr_batch_size, wall_time_s=0.0)
        total, initial = self.n_itr * self.itr_batch_size, self.start_itr * self.itr_batch_size
        progress = ProgressLine(total, "train", enabled=self.show_progress, initial=initial)
        returns: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        opt_info: dict[str, list[float]] = {}
        interval_t0, interval_steps = time.perf_counter(), 0
        try:
            for itr in range(self.start_itr, self.n_itr):
                samples = self.sampler.obtain_samples(itr)
                ep_ret, ep_len = samples.episode_stats()
                returns.append(ep_ret.copy())
                lengths.append(ep_len.copy())
                for key, value in self.algo.optimize_agent(itr, samples).items():
                    opt_info.setdefault(key, []).append(value)
                interval_steps += self.itr_batch_size
                result.itr, result.env_steps = itr, (itr + 1) * self.itr_batch_size
                if (itr + 1) % self.log_interval_itrs == 0 or itr == self.n_itr - 1:
                    elapsed = time.perf_counter() - interval_t0
                    row = self._log_row(itr, returns, lengths, opt_info, interval_steps / max(elapsed, 1e-9))
                    result.history.append(row)
                    returns, lengths, opt_info = [], [], {}
                    interval_t0, interval_steps = time.perf_counter(), 0
                    self.save_itr_snapshot(itr)
                    progress.update(result.env_steps, {k: row[k] for k in self._status_keys(row)})
                    perf = row.get(f"charts/{self.performance_source}_return_mean")
                    if self.stop_at_return is not None and perf is not None and perf >= self.stop_at_return:
                        result.target_reached_at_steps = result.env_steps
                        result.target_reached_at_s = row["charts/wall_time_s"]
                        break
        finally:
            progress.close()
        result.wall_time_s = self._elapsed_before_resume + (time.perf_counter() - self._t0)
        return result

    @staticmethod
    def _status_keys(row: dict[str, float]) -> list[str]:
        return [
            k for k in ("charts/online_return_mean", "charts/eval_return_mean", "charts/env_steps_per_s") if k in row
        ]

    def _log_row(
        self,
        itr: int,
        returns: list[np.ndarray],
        lengths: list[np.ndarray],
        opt_info: dict[str, list[float]],
        steps_per_s: float,
    ) -> dict[str, float]:
        ep_ret, ep_len = self.gather_episodes(np.concatenate(returns), np.concatenate(lengths))
        env_steps = (itr + 1) * self.itr_batch_size
        row: dict[str, float] = {
            "charts/itr": float(itr),
            "charts/env_steps": float(env_steps),
            "charts/env_steps_per_s": steps_per_s,
            "charts/wall_time_s": self._elapsed_before_resume + (time.perf_counter() - self._t0),
            **episode_metrics(ep_ret, ep_len),
        }
        row.update({k: float(np.mean(v)) for k, v in opt_info.items()})
        row.update(self.evaluate_performance())
        if self.logger is not None:
            self.logger.log(env_steps, row)
        return row


class MinibatchRlEval(MinibatchRl):
    """Like `MinibatchRl`, but performance is measured by deterministic evaluation episodes."""

    performance_source = "eval"

    def __init__(self, *args: Any, evaluator: Evaluator, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evaluator = evaluator

    def evaluate_performance(self) -> dict[str, float]:
        if self.rank != 0:
            return {}
        return evaluation_metrics(self.evaluator, self.agent)

    def get_itr_snapshot(self, itr: int) -> dict[str, Any]:
        # A resumed run evaluates on new episodes, not on those of its first evaluations again.
        return {**super().get_itr_snapshot(itr), "evaluator_calls": self.evaluator.calls}

    def _load_resume_state(self, state: dict[str, Any]) -> None:
        super()._load_resume_state(state)
        self.evaluator.calls = int(state.get("evaluator_calls", 0))

    def shutdown(self) -> None:
        super().shutdown()
        self.evaluator.close()
