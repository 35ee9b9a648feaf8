"""`SyncRl` and `SyncRlEval`: the `MinibatchRl` loop in W processes, gradients all-reduced.

    SyncLauncher (parent, not a rank)         rank r = 0 .. W-1 (spawned process)
    ---------------------------------         --------------------------------------------
    TCPStore server on 127.0.0.1:<free>  <--  join_group(gloo | nccl, timeout)
    start W processes ------------------->    runner = build(r, W)        # SyncRl(Eval)
                                              runner.train():  MinibatchRl loop, where
                                                agent.model = DDP(model)  # rank 0's weights
                                                PPO backward -> all-reduce of gradients
                                                gather_episodes -> all_gather of returns
    wait(sentinels + result pipes)  <-------    RankOutcome (JSON-able dict) on a pipe
    a rank died or raised -> terminate the
    others, raise WorkerDiedError(rank, code)
    (a user error in a rank keeps its class)

Where each side can block, and what bounds it:

    | wait                              | bounded by                                       |
    |-----------------------------------|--------------------------------------------------|
    | a rank in a collective on a dead  | `collective_timeout_s` (process-group timeout),  |
    | or stuck peer                     | and the parent terminating it when a peer dies   |
    | parent waiting on the ranks       | `timeout_s` for the whole run (None: no limit;   |
    |                                   | a death still wakes the parent at once)          |

Batch sizes are per rank, as in rlpyt: each rank samples `batch_T * batch_B` steps per
iteration, so one iteration sees W times as many and the effective batch grows with W.
`n_steps` counts the steps of all ranks. `runner.global_batch = true` in a `TrainConfig`
divides `batch_B` and the PPO minibatch by W instead, keeping the global batch fixed.

Every rank runs on this machine, so every port the run opens is on the loopback interface: the
store's (torch's own TCPStore server listens on every interface, and authenticates nobody) and
gloo's/NCCL's (`GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME=lo` unless set).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlplex import errors
from rlplex.control.elastic.entry import join_group
from rlplex.control.elastic.rdzv import LOCAL_HOST, dist_env, serve_tcp_store
from rlplex.errors import ConfigError, RlplexError, RunFailedError, WaitTimeoutError, WorkerDiedError
from rlplex.models import unwrap_model
from rlplex.processes import CONTEXT, start_process, stop_processes
from rlplex.runners.minibatch import MinibatchRl, MinibatchRlEval, TrainResult
from rlplex.samplers.rng import process_rng_state, set_process_rng_state

Backend = Literal["gloo", "nccl"]
RankBuilder = Callable[[int, int], "SyncRl"]
"""(rank, world_size) -> the runner of that rank. Must be picklable (module-level function or
functools.partial of one): it is sent to `spawn`ed processes."""


def param_digest(model: nn.Module) -> str:
    """SHA-256 of the parameters: equal digests on all ranks mean the replicas are in sync."""
    digest = hashlib.sha256()
    for name, tensor in unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def wrap_ddp(model: nn.Module, device_ids: list[torch.device] | None) -> DistributedDataParallel:
    """`model` under DDP with its buffers synced from rank 0 once, at construction, not at every forward.

    torch 2.13 says so with `forward_sync_buffers=False`. Older torch (a GPU machine's own build)
    has only `broadcast_buffers=False`, which skips the construction sync too, so the buffers are
    broadcast here first.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


class SyncRl(MinibatchRl):
    """The runner of one rank: `MinibatchRl` with DDP and episode statistics of all ranks.

    Build it like `MinibatchRl` with `rank` and `world_size` set, inside a process of an
    initialised process group (`SyncLauncher` does both). Rank 0 logs and snapshots; the
    episodes in its log are those of every rank. Batch sizes are per rank (see the module).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local_episodes = 0
        self.digests: dict[str, str] = {}

    def startup(self) -> None:
        if not dist.is_initialized():
            raise RlplexError(f"{type(self).__name__} needs a torch.distributed process group: use SyncLauncher")
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ConfigError(
                f"runner built for rank {self.rank} of {self.world_size}, but the process group says rank "
                f"{dist.get_rank()} of {dist.get_world_size()}"
            )
        if dist.get_backend() == "nccl" and self.device.type != "cuda":
            raise ConfigError(
                f"field 'runner.device': the nccl backend needs the model on a GPU, but the device is {self.device}; "
                'use device = "auto" or "cuda", or backend = "gloo"'
            )
        self.digests["built"] = param_digest(self.agent.model)
        super().startup()
        self.digests["start"] = param_digest(self.agent.model)

    def _place_model(self) -> None:
        # On the rank's device, then wrapped before `algo.initialize`, so that the optimizer sees
        # the DDP module and every backward all-reduces. DDP broadcasts rank 0's parameters at
        # construction: identical replicas. Buffers are synced at construction only: a sync on
        # every forward is a collective, and only rank 0 runs the evaluation forwards.
        super()._place_model()
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.agent.model = wrap_ddp(self.agent.model, device_ids)

    def save_itr_snapshot(self, itr: int) -> Path | None:
        # Every rank's streams go into rank 0's snapshot, so each rank continues its own on resume.
        # Every rank gets here at the same iterations (the loop is in lockstep), so the
        # collective cannot be left waiting.
        mine = {"process": process_rng_state(), "sampler": self.sampler.state_dict()}
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        self._rank_streams = every
        return super().save_itr_snapshot(itr)

    def get_itr_snapshot(self, itr: int) -> dict[str, Any]:
        state = super().get_itr_snapshot(itr)
        if getattr(self, "_rank_streams", None) is not None:
            state["ranks"] = self._rank_streams
        return state

    def _load_streams(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks")
        if isinstance(ranks, list) and len(ranks) == self.world_size:
            set_process_rng_state(ranks[self.rank]["process"])
            self.sampler.load_state_dict(ranks[self.rank]["sampler"])
            return
        if self.rank == 0:
            super()._load_streams(state)
            return
        # A snapshot of another world size (or of MinibatchRl) has no streams for this rank: a
        # new seed, distinct per rank and resume point, rather than rank 0's streams or a repeat.
        torch.manual_seed(self.seed + self.rank + 7919 * self.start_itr)
        np.random.seed((self.seed + self.rank + 7919 * self.start_itr) % 2**32)

    def train(self) -> TrainResult:
        result = super().train()
        if self.final_streams_digest is not None:
            self.digests["streams"] = self.final_streams_digest
        return result

    def shutdown(self) -> None:
        self.digests["final"] = param_digest(self.agent.model)
        super().shutdown()

    def _comm_device(self) -> torch.device:
        nccl = dist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def gather_episodes(self, returns: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Episodes of all ranks, on all ranks.

        `all_gather` rather than a gather to rank 0: every rank then computes the same row, so the
        `stop_at_return` decision is the same everywhere and no rank is left in a collective.
        """
        self.local_episodes += len(returns)
        device, world = self._comm_device(), self.world_size
        count = torch.tensor([len(returns)], dtype=torch.int64, device=device)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count)
        sizes = [int(c.item()) for c in counts]
        # Counts differ per rank and all_gather needs equal shapes: pad to the largest.
        padded = torch.zeros((2, max(1, *sizes)), dtype=torch.float64, device=device)
        padded[0, : len(returns)] = torch.as_tensor(returns, dtype=torch.float64)
        padded[1, : len(lengths)] = torch.as_tensor(lengths, dtype=torch.float64)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        stats = np.concatenate([p[:, :n].cpu().numpy() for p, n in zip(parts, sizes, strict=True)], axis=1)
        return stats[0].astype(returns.dtype, copy=False), stats[1].astype(lengths.dtype, copy=False)


class SyncRlEval(SyncRl, MinibatchRlEval):
    """`SyncRl` whose performance is measured by evaluation episodes, run on rank 0 only.

    Rank 0 broadcasts its evaluation metrics so that every rank's row, and so every rank's
    `stop_at_return` decision, is the same: the ranks stop together.
    """

    def evaluate_performance(self) -> dict[str, float]:
        box: list[dict[str, float]] = [super().evaluate_performance() if self.rank == 0 else {}]
        dist.broadcast_object_list(box, src=0, device=self._comm_device())
        return box[0]


@dataclass
class RankOutcome:
    """What a rank reports to the launcher (sent as a plain dict)."""

    rank: int
    error: str | None = None
    # A user error (an rlplex error other than a failed run) keeps its class: `rlplex train`
    # then reports it as a bad input (exit 2) rather than as a failed run (exit 1).
    user_error_type: str | None = None
    result: dict[str, Any] | None = None
    local_episodes: int = 0
    digests: dict[str, str] | None = None


def _rank_main(
    build: RankBuilder,
    rank: int,
    world_size: int,
    backend: Backend,
    store_port: int,
    collective_timeout_s: float,
    resume_dir: str | None,
    conn: Connection,
) -> None:
    torch.set_num_threads(1)
    outcome = RankOutcome(rank=rank)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # Ranks of one machine: the launcher serves the store, as rank 0's node does for a round.
        assignment = {"rank": rank, "local_rank": rank, "world": world_size, "local_world": world_size}
        os.environ.update(dist_env(assignment | {"group_rank": 0, "addr": LOCAL_HOST, "port": store_port}))
        join_group(backend, collective_timeout_s, alone=True)
        runner = build(rank, world_size)
        if not isinstance(runner, SyncRl):
            raise ConfigError(f"the rank builder must return a SyncRl or SyncRlEval, got {type(runner).__name__}")
        if resume_dir is not None:
            runner.resume_from(resume_dir)
        outcome.result = asdict(runner.train())
        outcome.local_episodes, outcome.digests = runner.local_episodes, runner.digests
    except BaseException as exc:
        outcome.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        if isinstance(exc, RlplexError) and not isinstance(exc, RunFailedError):
            outcome.user_error_type, outcome.error = type(exc).__name__, str(exc)
    # Report before tearing the group down: with a peer stuck in a collective, teardown can
    # block, and the parent should learn of the failure at once (it then terminates us).
    conn.send(asdict(outcome))
    conn.close()
    if outcome.error is not None:
        # Skip interpreter teardown: it would run the process group's destructors against dead peers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


class SyncLauncher:
    """Runs `build(rank, world_size)` in `world_size` processes and returns rank 0's result.

    Has the runner interface (`resume_from`, `train`), so `build_runner` can return it. A rank
    that raises or dies ends the run: the others are terminated and `WorkerDiedError` names the
    rank, its exit code and its error. `rank_outcomes` holds every rank's report after `train`.
    """

    def __init__(
        self,
        build: RankBuilder,
        world_size: int = 2,
        backend: Backend = "gloo",
        collective_timeout_s: float = 120.0,
        timeout_s: float | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"field 'runner.world_size': must be at least 1 (got {world_size})")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("field 'runner.backend': 'nccl' needs CUDA, which is not available here; use 'gloo'")
        self.build = build
        self.world_size = world_size
        self.backend: Backend = backend
        self.collective_timeout_s = collective_timeout_s
        self.timeout_s = timeout_s
        self.processes: list[BaseProcess] = []
        self.rank_outcomes: list[RankOutcome] = []
        self._resume_dir: str | None = None

    def resume_from(self, snapshot_dir: str | Path) -> None:
        """Every rank loads this snapshot (written by rank 0) before training."""
        self._resume_dir = str(snapshot_dir)

    def train(self) -> TrainResult:
        # The parent serves the store, so its port stays taken from pick to use (no race); on a
        # socket bound to 127.0.0.1, which torch's own server would not do.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((LOCAL_HOST, 0))
            store = serve_tcp_store(sock, self.collective_timeout_s)
        finally:
            sock.close()  # serve_tcp_store detached it; a failed bind leaves it to close here
        self.processes, conns = [], []
        try:
            for rank in range(self.world_size):
                receiver, sender = CONTEXT.Pipe(duplex=False)
                args = (
                    self.build,
                    rank,
                    self.world_size,
                    self.backend,
                    store.port,
                    self.collective_timeout_s,
                    self._resume_dir,
                    sender,
                )
                # Not a daemon: a rank may start sampler worker processes of its own.
                process = start_process(_rank_main, args, f"rank {rank}", daemon=False)
                sender.close()
                self.processes.append(process)
                conns.append(receiver)
            self.rank_outcomes = self._wait(conns)
            for process in self.processes:
                process.join(timeout=self.collective_timeout_s)  # ranks exit right after reporting
        finally:
            stop_processes(self.processes)
            for conn in conns:
                conn.close()
            del store
        result = self.rank_outcomes[0].result
        assert result is not None
        return TrainResult(**result)

    def _wait(self, conns: list[Connection]) -> list[RankOutcome]:
        """Collect every rank's outcome; the first failure ends the wait."""
        outcomes: dict[int, RankOutcome] = {}
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while len(outcomes) < self.world_size:
            waiting = [r for r in range(self.world_size) if r not in outcomes]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            objects: list[Any] = [conns[r] for r in waiting] + [self.processes[r].sentinel for r in waiting]
            ready = wait(objects, timeout=remaining)
            if not ready:
                raise WaitTimeoutError(
                    f"SyncLauncher: ranks {waiting} did not finish within timeout_s={self.timeout_s} s"
                )
            failed: list[tuple[int, RankOutcome | None]] = []
            for rank in waiting:
                process, conn = self.processes[rank], conns[rank]
                if conn not in ready and process.sentinel not in ready:
                    continue
                # A rank that exited may still have its report in the pipe: read it first.
                outcome = _read_outcome(conn)
                if outcome is not None and outcome.error is None:
                    outcomes[rank] = outcome
                    continue
                failed.append((rank, outcome))
            if failed:
                # A rank gone without a report (killed, crashed) is the cause: the errors the others
                # report at the same time are their collectives failing on the lost peer.
                rank, outcome = min(failed, key=lambda failure: failure[1] is not None)
                if outcome is not None and outcome.user_error_type is not None:
                    raise _user_error(outcome.user_error_type, f"rank {rank}: {outcome.error}")
                process = self.processes[rank]
                process.join(timeout=5.0)
                code = "still running" if process.exitcode is None else f"exit code {process.exitcode}"
                detail = outcome.error if outcome is not None else "no report (killed or crashed)"
                raise WorkerDiedError(f"rank {rank} (pid {process.pid}) died with {code}: {detail}")
        return [outcomes[r] for r in range(self.world_size)]


def _user_error(type_name: str, message: str) -> RlplexError:
    """The user error a rank reported, by class name: only rlplex's own error classes qualify."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, RlplexError) and not issubclass(cls, RunFailedError):
        try:
            return cls(message)
        except TypeError:  # a class with another constructor: its message is what matters
            pass
    return ConfigError(message)


def _read_outcome(conn: Connection) -> RankOutcome | None:
    if not conn.poll():
        return None
    try:
        return RankOutcome(**conn.recv())
    except EOFError:  # the rank died before it could report
        return None
