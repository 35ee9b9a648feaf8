"""`AsyncRl` and `AsyncRlEval`: sampling and optimization in separate processes.

```
 AsyncSampler (rlplex.samplers.async_): sampler process -> double buffer -> copiers -> replay
 master = this runner = the optimizer:
   loop: allowed = floor(replay_ratio * env_steps / batch_size) - updates_done
         allowed > 0 -> algo.optimize_agent(itr, None, n_updates=min(allowed, chunk))
                        -> publish weights (version + 1)
         else        -> wait on the copiers' progress condition (timeout, then check children)
```

| where backpressure comes from | what it bounds |
| --- | --- |
| the replay-ratio throttle (here) | updates never exceed `replay_ratio` x env steps / batch size |
| the double buffer's "copied" semaphores | the sampler is at most two batches ahead of the copiers |
| `min_replay_ratio` (off by default) | the sampler waits while updates fall below the floor |
| nothing else | a slow optimizer does not slow the sampler: the achieved ratio drops, and is logged |

`min_replay_ratio` is Sample Factory's bound from the other side, on how far sampling may run
ahead of a slow optimizer: the sampler starts no batch while updates x batch size are below
`min_replay_ratio` x the env steps copied.

`replay_ratio` is a ceiling, not a target (the seed's example: with a sampler at 1,000
steps/s, batch size 100 and ratio 1 the optimizer does at most 10 updates/s; if it manages
only 5, both sides run at full speed and the logged ratio is 0.5). The log has the ratio of
each interval, the cumulative ratio and the fraction of time the optimizer was busy.

Resuming restores parameters, the algorithm (optimizer, replay buffer, counters), the step
counters and the random streams: the master's generators, and the sampler's (its process's,
its workers', its environments') as they were right after the last batch the snapshot counts,
so the resumed sampler draws on where the uninterrupted one did. The optimizer's side cannot
be bit-exact, because the interleaving of the processes is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rlplex.agents.base import Agent, AgentFactory
from rlplex.diagnostics import MetricsLogger, ProgressLine
from rlplex.diagnostics.trackers import Tracking
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import ConfigError, SnapshotError, WaitTimeoutError
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
from rlplex.runners.minibatch import TrainResult
from rlplex.samplers.async_ import POLL_S, AsyncSampler
from rlplex.samplers.base import Evaluator
from rlplex.samplers.rng import streams_digest


class ReplayAlgo(Protocol):
    """What AsyncRl needs of an off-policy algorithm (DQN is one). Its class must be
    constructible as `type(algo)(algo.config)`: that is how copiers get their own."""

    config: Any
    update_count: int
    replay: Any

    @property
    def batch_size(self) -> int: ...

    @property
    def learning_starts(self) -> int: ...

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None: ...

    def copier_factory(self, batch_B: int) -> Callable[[], Any]: ...

    def sampler_to_buffer(self, samples: Any) -> dict[str, np.ndarray]: ...

    def optimize_agent(self, itr: int, samples: Any, n_updates: int | None = None) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class _Interval:
    t0: float
    env_steps: int
    updates: int
    wait_s: float = 0.0


class AsyncRl:
    performance_source = "online"

    def __init__(
        self,
        algo: ReplayAlgo,
        agent_factory: AgentFactory,
        env: EnvConfig,
        batch_T: int,
        batch_B: int,
        n_steps: int,
        replay_ratio: float,
        seed: int = 0,
        log_interval_steps: int = 10_000,
        log_dir: str | Path | None = None,
        snapshot_mode: SnapshotMode = "last",
        snapshot_gap: int = 1,
        stop_at_return: float | None = None,
        show_progress: bool = True,
        max_updates_per_chunk: int = 32,
        schedule_steps: int | None = None,
        n_workers: int | None = None,
        envpool: bool = False,
        device: str = "auto",
        min_replay_ratio: float | None = None,
    ) -> None:
        """`n_workers`: None samples in one sampler process; a number, in that many worker
        processes behind it (`[sampler] kind = "parallel"`). `envpool`: the sampler process
        steps its environments with EnvPool (`[sampler] kind = "envpool"`). `device`: where
        the learner's model and its minibatches live ("auto": CUDA when present); the
        sampler's processes act on CPU copies. `min_replay_ratio`: a floor under the replay
        ratio, held by making the sampler wait (see the module); at most `replay_ratio`."""
        if n_steps <= 0 or replay_ratio <= 0:
            raise ConfigError(
                f"field 'runner': n_steps and replay_ratio must be positive (got {n_steps}, {replay_ratio})"
            )
        self.algo, self.agent_factory, self.env_config = algo, agent_factory, env
        self.batch_T, self.batch_B, self.n_workers, self.envpool = batch_T, batch_B, n_workers, envpool
        self.itr_batch_size = batch_T * batch_B
        self.n_itr = max(1, -(-n_steps // self.itr_batch_size))
        self.schedule_itrs = schedule_itrs(schedule_steps, n_steps, self.itr_batch_size)
        self._schedule_given = schedule_steps is not None
        self.replay_ratio = replay_ratio
        if min_replay_ratio is not None and not 0 < min_replay_ratio <= replay_ratio:
            raise ConfigError(
                f"field 'runner.min_replay_ratio': must be positive and at most runner.replay_ratio = {replay_ratio} "
                f"(got {min_replay_ratio})"
            )
        self.min_replay_ratio = min_replay_ratio
        self.seed = seed
        self.log_interval_steps = max(1, log_interval_steps)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.snapshot_mode: SnapshotMode = snapshot_mode if self.log_dir is not None else "none"
        self.snapshot_gap = snapshot_gap
        self.stop_at_return = stop_at_return
        self.show_progress = show_progress
        # Small chunks keep the master responsive: it re-checks children and logs between them.
        self.max_updates_per_chunk = max_updates_per_chunk
        self._resume_state: dict[str, Any] | None = None
        # Told of every logged row, (env steps, metrics): how a supervised run's node reports progress.
        self.on_log_row: Callable[[int, Mapping[str, float]], None] | None = None
        self.tracking: Tracking | None = None  # `[logging]`'s trackers; None: TensorBoard in log_dir/tb
        self.start_env_steps = 0
        self.logger: MetricsLogger | None = None
        self._sampler_state: dict[str, Any] | None = None  # streams that go with the logged env steps
        self.final_streams_digest: str | None = None  # the sampler's streams at the end of a completed run
        self.device = resolve_device(device, "runner.device")

    # ----- setup and teardown -------------------------------------------------------------
    def startup(self) -> None:
        torch.manual_seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.set_num_threads(1)
        self.spaces = probe_spaces(self.env_config)
        self.agent: Agent = self.agent_factory(self.spaces)
        self.agent.model.to(self.device)
        self.algo.initialize(self.agent, n_itr=self.schedule_itrs, world_size=1, shared_replay=True)
        algo_factory = self.algo.copier_factory(self.batch_B)  # before a resume loads into what it shares
        if self._resume_state is not None:
            self._load_resume_state(self._resume_state)
        self.sampler = AsyncSampler(self.env_config, self.batch_T, self.batch_B, self.n_workers, self.envpool)
        start_batches = self.start_env_steps // self.itr_batch_size
        restore = None if self._resume_state is None else self._resume_state.get("sampler")
        self.sampler.start(
            self.agent_factory,
            self.spaces,
            unwrap_model(self.agent.model),
            algo_factory,
            self.algo.replay.handle,
            n_batches=self.n_itr - start_batches,
            # A snapshot from before streams were saved: fresh, distinct seeds rather than a repeat.
            seed=self.seed if restore is not None or not start_batches else self.seed + start_batches,
            start_env_steps=self.start_env_steps,
            restore=restore,
        )
        self.algo.replay.wait_check = self.sampler.check_alive
        resumed_at = None if self._resume_state is None else self.start_env_steps
        self.logger = (
            MetricsLogger(self.log_dir, resumed_at=resumed_at, on_row=self.on_log_row, tracking=self.tracking)
            if self.log_dir is not None
            else None
        )

    def shutdown(self) -> None:
        if hasattr(self, "sampler"):
            self.sampler.shutdown()
        self.algo.shutdown()
        if self.logger is not None:
            self.logger.close()

    # ----- snapshots ----------------------------------------------------------------------
    def get_itr_snapshot(self, itr: int) -> dict[str, Any]:
        model = unwrap_model(self.agent.model)
        return {
            "itr": itr,
            "env_steps": (itr + 1) * self.itr_batch_size,
            "agent": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "algo": self.algo.state_dict(),
            "algo_name": algo_name(self.algo),
            "rng": rng_state(),
            **({"sampler": self._sampler_state} if self._sampler_state is not None else {}),
            "seed": self.seed,
            "itr_batch_size": self.itr_batch_size,
            "schedule_itrs": self.schedule_itrs,
        }

    def save_itr_snapshot(self, itr: int) -> Path | None:
        if self.log_dir is None:
            return None
        state = self.get_itr_snapshot(itr)
        return save_by_mode(self.log_dir / "snapshots", itr, state, self.snapshot_mode, self.snapshot_gap)

    def resume_from(self, snapshot_dir: str | Path) -> None:
        state = read_snapshot(snapshot_dir)
        check_same_algo(state, self.algo, snapshot_dir)
        state["__source__"] = str(snapshot_dir)
        self._resume_state = state
        self.schedule_itrs = resumed_schedule_itrs(state, self.schedule_itrs, self._schedule_given)
        self.start_env_steps = int(state["env_steps"])

    def _load_resume_state(self, state: dict[str, Any]) -> None:
        inner = unwrap_model(self.agent.model)
        check_compatible(inner.state_dict(), state["agent"], Path(state["__source__"]))
        inner.load_state_dict(state["agent"])
        self.algo.load_state_dict(state["algo"])
        try:
            set_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise SnapshotError(f"{state['__source__']}: malformed random generator state: {error}") from None

    # ----- the loop -----------------------------------------------------------------------
    def evaluate_performance(self) -> dict[str, float]:
        return {}

    def train(self) -> TrainResult:
        try:
            self.startup()
            return self._loop()
        except WaitTimeoutError:
            if hasattr(self, "sampler"):
                self.sampler.check_alive()  # a dead child is the better explanation of a timeout
            raise
        finally:
            self.shutdown()

    def _learning_started(self) -> bool:
        return self.algo.replay.size >= max(1, self.algo.learning_starts)

    def _allowed_updates(self, env_steps: int) -> int:
        if not self._learning_started():
            return 0
        ceiling = int(self.replay_ratio * env_steps / self.algo.batch_size)
        return ceiling - self.algo.update_count

    def _limit_sampling(self) -> None:
        """With a floor: the env steps the sampler may have copied before its next batch, as
        many as the updates done so far cover, and one update more. The floor holds once updates
        can run (the replay holds `learning_starts`); it can always be met, since the throttle
        allows updates up to `replay_ratio` x the steps copied and the floor is at most that. The
        one update more is what makes it so: the throttle rounds the updates it allows down, so
        with the floor at the ceiling the updates done cover a little less than the steps copied,
        and without it the optimizer would wait for steps and the sampler for updates for ever."""
        if self.min_replay_ratio is None:
            return
        if not self._learning_started():
            self.sampler.limit_sampling(-1)
            return
        covered = (self.algo.update_count + 1) * self.algo.batch_size / self.min_replay_ratio
        self.sampler.limit_sampling(int(covered))

    def _wait_first_batch(self, timeout_s: float = 120.0) -> None:
        # Process start-up (spawn, imports) is not sampling: rates are measured from here.
        deadline = time.monotonic() + timeout_s
        while not self.sampler.wait_for_steps(self.start_env_steps + 1, timeout=POLL_S):
            self.sampler.check_alive()
            if time.monotonic() > deadline:
                raise WaitTimeoutError(f"AsyncRl: no sample batch from the sampler process within {timeout_s} s")

    def _loop(self) -> TrainResult:
        self._wait_first_batch()
        self._t0 = time.perf_counter()
        sampler, total = self.sampler, self.n_itr * self.itr_batch_size
        result = TrainResult(itr=0, env_steps=self.start_env_steps, wall_time_s=0.0)
        progress = ProgressLine(total, "async", enabled=self.show_progress, initial=self.start_env_steps)
        self._start_updates = self.algo.update_count
        interval = _Interval(self._t0, sampler.env_steps, self.algo.update_count)
        opt_info: dict[str, list[float]] = {}
        next_log = self.start_env_steps + self.log_interval_steps
        last_itr = -2
        try:
            while True:
                sampler.check_alive()
                self._limit_sampling()  # before a chunk of updates too: it can take a while
                env_steps = sampler.env_steps
                finished = env_steps >= total
                allowed = self._allowed_updates(env_steps)
                # After the last batch, finish its share of updates only if keeping up (a slow
                # optimizer's backlog is the shortfall the log reports, not work to do now).
                per_batch = self.replay_ratio * self.itr_batch_size / self.algo.batch_size
                if finished and (allowed <= 0 or allowed > 2 * per_batch + 1):
                    break
                itr = env_steps // self.itr_batch_size - 1
                if allowed > 0 or itr != last_itr:
                    # With nothing to update yet (learning_starts), a new batch still moves the
                    # schedules on (epsilon), and the sampler must see them.
                    n_updates = min(max(allowed, 0), self.max_updates_per_chunk)
                    info = self.algo.optimize_agent(itr, None, n_updates=n_updates)
                    last_itr = itr
                    if n_updates:
                        for key, value in info.items():
                            opt_info.setdefault(key, []).append(value)
                    sampler.publish_weights(unwrap_model(self.agent.model))
                else:
                    t_wait = time.perf_counter()
                    sampler.wait_for_steps(env_steps + 1, timeout=POLL_S)
                    interval.wait_s += time.perf_counter() - t_wait
                if sampler.env_steps >= next_log:
                    row = self._log_row(interval, opt_info)
                    result.history.append(row)
                    result.env_steps = int(row["charts/env_steps"])
                    result.itr = result.env_steps // self.itr_batch_size - 1
                    interval, opt_info = _Interval(time.perf_counter(), result.env_steps, self.algo.update_count), {}
                    next_log = (result.env_steps // self.log_interval_steps + 1) * self.log_interval_steps
                    if self._advance_schedules(result.itr, last_itr):
                        last_itr = result.itr
                        sampler.publish_weights(unwrap_model(self.agent.model))
                    self.save_itr_snapshot(result.itr)
                    progress.update(result.env_steps, {k: row[k] for k in self._status_keys(row)})
                    perf = row.get(f"charts/{self.performance_source}_return_mean")
                    if self.stop_at_return is not None and perf is not None and perf >= self.stop_at_return:
                        result.target_reached_at_steps = result.env_steps
                        result.target_reached_at_s = row["charts/wall_time_s"]
                        return result
            if sampler.env_steps > interval.env_steps or not result.history:
                result.history.append(self._log_row(interval, opt_info))
            result.env_steps, self._sampler_state = sampler.progress_state()
            result.itr = result.env_steps // self.itr_batch_size - 1
            if self._sampler_state is not None:
                self.final_streams_digest = streams_digest(self._sampler_state["processes"])
            self._advance_schedules(result.itr, last_itr)
            self.save_itr_snapshot(result.itr)
            return result
        finally:
            result.wall_time_s = time.perf_counter() - self._t0
            progress.close()

    def _advance_schedules(self, itr: int, last_itr: int) -> bool:
        """Bring the algorithm's schedules (epsilon) to `itr` with no updates, so a snapshot holds
        the values of its own iteration even when a lagging optimizer never reached it."""
        if itr <= last_itr:
            return False
        self.algo.optimize_agent(itr, None, n_updates=0)
        return True

    @staticmethod
    def _status_keys(row: dict[str, float]) -> list[str]:
        keys = ("charts/online_return_mean", "charts/eval_return_mean", "charts/env_steps_per_s", "charts/replay_ratio")
        return [k for k in keys if k in row]

    def _log_row(self, interval: _Interval, opt_info: dict[str, list[float]]) -> dict[str, float]:
        now = time.perf_counter()
        # The states with the count: the snapshot of this row then resumes the sampler's streams
        # from right after the last batch it counts.
        env_steps, self._sampler_state = self.sampler.progress_state()
        updates = self.algo.update_count
        elapsed = max(now - interval.t0, 1e-9)
        d_steps, d_updates = env_steps - interval.env_steps, updates - interval.updates
        batch = self.algo.batch_size
        row: dict[str, float] = {
            "charts/env_steps": float(env_steps),
            "charts/updates": float(updates),
            "charts/env_steps_per_s": d_steps / elapsed,
            "charts/updates_per_s": d_updates / elapsed,
            "charts/replay_ratio": d_updates * batch / max(d_steps, 1),
            "charts/replay_ratio_cumulative": updates * batch / max(env_steps, 1),
            "charts/replay_ratio_set_point": self.replay_ratio,
            "charts/optimizer_busy_fraction": 1.0 - min(1.0, interval.wait_s / elapsed),
            "charts/wall_time_s": now - self._t0,
        }
        row.update(episode_metrics(*self.sampler.new_episodes()))
        row.update({k: float(np.mean(v)) for k, v in opt_info.items()})
        row.update(self.evaluate_performance())
        if self.logger is not None:
            self.logger.log(env_steps, row)
        return row


class AsyncRlEval(AsyncRl):
    """Like `AsyncRl`, with deterministic evaluation episodes in the master every log interval."""

    performance_source = "eval"

    def __init__(self, *args: Any, evaluator: Evaluator, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evaluator = evaluator

    def evaluate_performance(self) -> dict[str, float]:
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
