"""Workers for the control-plane tests. Faults come from RLPLEX_TEST_FAULTS="kind@node_id,..."
(never from product code): stall (incarnation 0 stops progressing), crash (every incarnation
fails after one item), self_check, check_child (the hook raises), slow_check (the self_check of
every incarnation after the first takes 5 s)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.control import SubMaster, Worker, WorkerContext, WorkerLoad
from rlplex.control.elastic.master import ElasticWorker


def faults(context: WorkerContext) -> set[str]:
    out = set()
    for item in os.environ.get("RLPLEX_TEST_FAULTS", "").split(","):
        kind, _, node = item.partition("@")
        if node == context.node_id:
            out.add(kind)
    return out


class Counter(WorkerLoad):
    """Processes items i with i % world == rank, one line per item in items/<node_id>.txt; resumes from it."""

    def self_check(self) -> None:
        if "self_check" in faults(self.context):
            raise RuntimeError("injected self_check failure: disk not writable")
        if "slow_check" in faults(self.context) and self.context.incarnation > 0:
            time.sleep(5.0)  # a node that loads a model before it reports ready

    def run(self) -> None:
        cfg = self.context.config
        n_items, delay = int(cfg.get("items", 10)), float(cfg.get("delay_s", 0.01))
        world = self.context.world[self.context.role]
        path = Path(self.context.output_dir) / "items" / f"{self.context.node_id}.txt"
        path.parent.mkdir(exist_ok=True)
        done = {int(x) for x in path.read_text().split()} if path.exists() else set()
        my_faults = faults(self.context)
        with path.open("a") as out:
            for item in range(self.context.rank, n_items, world):
                if self.context.should_stop():
                    return
                if item in done:
                    continue
                time.sleep(delay)
                out.write(f"{item}\n")
                out.flush()
                done.add(item)
                self.context.report_progress(items=len(done))
                if "crash" in my_faults:
                    raise RuntimeError("injected crash")
                hold = cfg.get("hold_until")  # a file the test creates: the node waits, beating, until then
                if hold and len(done) >= int(cfg.get("hold_after", 3)):
                    while not (Path(self.context.output_dir) / str(hold)).exists() and not self.context.should_stop():
                        time.sleep(0.02)
                if "stall" in my_faults and self.context.incarnation == 0 and len(done) >= 2:
                    while not self.context.should_stop():
                        time.sleep(0.05)  # alive and beating, but no progress
                    return


class Idle(Worker):
    """Runs until stopped; answers calls (trainer-driven tests)."""

    def double(self, x: float) -> float:
        return 2 * x

    def add(self, x: float, y: float) -> float:
        return x + y

    def whoami(self) -> dict[str, Any]:
        return {"rank": self.context.rank, "pid": os.getpid()}


class PreloadedIdle(Idle):
    """Idle, once it has imported `preload_probe` (a job that preloads it has done so in its fork server)."""

    def __init__(self, context: WorkerContext) -> None:
        import preload_probe  # noqa: F401

        super().__init__(context)

    def draws(self) -> list[float]:
        """The global random states' first draws: a fresh process's differ from its siblings'."""
        import numpy as np
        import torch

        return [float(np.random.random()), float(torch.rand(()))]


class Sub(SubMaster):
    def check_child(self) -> None:
        if "check_child" in faults(self.context):
            raise RuntimeError("injected check_child failure: child rank 1 unreachable")


def drive(context: WorkerContext) -> None:
    """A trainer-driven driver: scatter work over the 'idle' role and record the results."""
    group = context.role_group("idle")
    results = [f.result(timeout=10) for f in group.scatter("double", [1, 2, 3, 4])]
    who = [f.result(timeout=10) for f in group.call("whoami")]
    rank0 = group.call_rank(0, "add", 10, 20).result(timeout=10)
    group.close()
    Path(context.output_dir, "driver.txt").write_text(repr((results, who, rank0)))


def quick(context: WorkerContext) -> None:
    """A function entry point that finishes at once."""
    context.report_progress(done=1)


NOT_A_WORKER = 42


def token_probe(context: WorkerContext) -> None:
    """Record where this entry point finds the job token: its environment, a child's, its launch environment."""
    token = context.token.hex()
    child = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
    seen = {
        "environ": os.environ.get("RLPLEX_JOB_TOKEN"),
        "child": any(line == f"RLPLEX_JOB_TOKEN={token}" for line in child.splitlines()),
        "launch": token.encode() in Path("/proc/self/environ").read_bytes(),
        "matches": os.environ.get("RLPLEX_JOB_TOKEN") == token,
    }
    folder = Path(context.output_dir) / "token"
    folder.mkdir(exist_ok=True)
    (folder / f"{context.node_id}.json").write_text(json.dumps(seen))


def channel_owner(context: WorkerContext) -> None:
    """Leaves a job channel holding an item (a channel outlives its creator), and its name in channel.txt."""
    from rlplex.control import LocalDataChannel

    channel = LocalDataChannel.create(context.channel_name("q"), capacity=2, slot_bytes=4096)
    channel.put({"item": 1})
    channel.detach()
    (Path(context.output_dir) / "channel.txt").write_text(context.channel_name("q"))


class CheckedElasticWorker(ElasticWorker):
    """An ElasticWorker whose node check fails (node_check@trainer-1) or never ends (hang_check@trainer-1)."""

    def start_node_check(self, assignment: dict[str, Any]) -> dict[str, Any] | None:
        if "node_check" in faults(self.context):
            return {"ok": False, "error": "injected node check failure: gloo all-reduce timed out"}
        if "hang_check" in faults(self.context):
            return None  # no check process, so no result ever
        return super().start_node_check(assignment)


class WaiterConfig(StrictModel):
    out: Path
    seconds: float = Field(gt=0)


def wait_for_stop(config: WaiterConfig) -> int:
    """A function entry point (`rlplex.control.elastic.entry`): writes `ready`, waits until its graceful stop
    (or `seconds`), then writes `stopped` or `timed out` and exits 0."""
    from rlplex.control.elastic.entry import stop_event

    config.out.write_text("ready")
    stopped = stop_event().wait(config.seconds)
    config.out.write_text("stopped" if stopped else "timed out")
    return 0


# ----- self-loop stages (SelfLoopWorker's `stage` functions) ------------------------------------
def numbers(context: WorkerContext) -> Callable[[], Iterator[int]]:
    items = int(context.config["settings"]["items"])
    return lambda: iter(range(items))


def doubled(context: WorkerContext) -> Callable[[int], int]:
    return lambda x: 2 * x


def collected(context: WorkerContext) -> Callable[[int], None]:
    """Appends each item to `collected.txt` in the job's folder."""
    path = Path(context.output_dir) / "collected.txt"

    def take(item: int) -> None:
        with path.open("a") as file:
            file.write(f"{item}\n")

    return take
