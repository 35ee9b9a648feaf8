"""Elastic recovery: 4 ranks of examples/elastic_train.py under an ElasticMaster; one rank is
killed mid-training; how long until the loss is detected, the group re-rendezvoused, and the
training resumed (first step after the restart), and how many steps were lost (redone since
the last checkpoint).

    python -m benchmarks.elastic_recovery [--quick] [--kill node|script] [--ranks 4]

`--kill node` SIGKILLs the rank's node process group (node and script: a lost machine; the
PrimeManager restarts the node and the ElasticMaster takes the replacement in, after its node
check); `--kill script` SIGKILLs only the script (the ElasticMaster restarts every script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import report
from rlplex.control import JobBuilder, JobSpec, JobState, PrimeMaster
from rlplex.control.elastic.master import read_elastic_status

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "elastic_train.py")


def job(out: Path, ranks: int, steps: int, ckpt_every: int, step_delay: float) -> JobSpec:
    args = ["--steps", str(steps), "--ckpt-every", str(ckpt_every), "--step-delay", str(step_delay)]
    return (
        JobBuilder("elastic-bench", out, capacity={"cpu": 2}, heartbeat_interval_s=0.1, rpc_timeout_s=300.0)
        .role("trainer", entrypoint="rlplex.control.elastic:ElasticWorker", count=ranks, resources={"cpu": 0.4},
              config={"script": SCRIPT, "args": args})
        .role("elastic", kind="submaster", entrypoint="rlplex.control.elastic:ElasticMaster", resources={"cpu": 0.1},
              config={"workers": "trainer", "join_timeout_s": 30.0, "check_timeout_s": 120.0})
        .build()
    )  # fmt: skip


def step_of(out: Path, node_id: str) -> float:
    try:
        return float(json.loads((out / "elastic" / "progress" / f"{node_id}.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0.0


def run(out: Path, ranks: int, steps: int, ckpt_every: int, step_delay: float, kill: str) -> dict[str, Any]:
    victim_id = f"trainer-{ranks - 1}"
    kill_after = ckpt_every * 2 + ckpt_every // 2  # mid-way between two checkpoints
    with PrimeMaster.create(job(out, ranks, steps, ckpt_every, step_delay)) as master:
        master.start()
        deadline = time.monotonic() + 300
        while step_of(out, victim_id) < kill_after:
            if master.monitor() != JobState.RUNNING or time.monotonic() > deadline:
                raise RuntimeError(f"training did not reach step {kill_after}: {master.state}")
            time.sleep(0.01)
        node = next(n for n in master.get_nodes_by_role()["trainer"] if n.node_id == victim_id)
        at_kill = max(step_of(out, f"trainer-{r}") for r in range(ranks))
        killed_at = time.time()
        if kill == "node":
            os.killpg(node.pid, signal.SIGKILL)
        else:
            import psutil

            (script,) = [p for p in psutil.Process(node.pid).children() if SCRIPT in p.cmdline()]
            script.send_signal(signal.SIGKILL)
        state = master.wait(timeout=600)
        transitions = [r for r in master.store.transitions(master.job_id) if r.entity == "elastic-0:rendezvous"]
    status = read_elastic_status(out)
    (result_file,) = (out / "elastic" / "checkpoints").glob("*/result.json")
    result = json.loads(result_file.read_text())
    first, second = status["rounds"][0], status["rounds"][1]
    detected = min(r.at for r in transitions if r.new == "RESTARTING")
    rerendezvous = min(r.at for r in transitions if r.new == "RUNNING" and r.at > detected)
    after = {r.new: r.at for r in reversed(transitions) if detected <= r.at <= rerendezvous}
    return {
        "ranks": ranks,
        "kill": kill,
        "state": state.value,
        "steps": result["steps"],
        "final_loss": result["final_loss"],
        "checkpoint_every": ckpt_every,
        "step_at_kill": at_kill,
        "resumed_from": second["resumed_from"],
        "steps_lost": at_kill - float(second["resumed_from"]),
        "kill_to_detect_s": detected - killed_at,
        "kill_to_rerendezvous_s": rerendezvous - killed_at,
        "kill_to_resumed_s": second["first_step_at"] - killed_at,
        "survivors_stopped_s": after["WAITING"] - detected,
        "members_gathered_s": after.get("CHECKING", after["READY"]) - after["WAITING"],
        "replacement_checked_s": after["READY"] - after["CHECKING"] if "CHECKING" in after else 0.0,
        "script_start_to_first_step_s": first["first_step_at"] - first["started_at"],
        "restart_to_first_step_s": second["first_step_at"] - second["started_at"],
        "restarts": status["restarts"],
        "load_avg_1m_at_end": os.getloadavg()[0],
        "checked_after_kill": sorted(status["checks"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--kill", choices=["node", "script"], default="node")
    args = parser.parse_args(argv)
    steps, ckpt_every = (120, 20) if args.quick else (300, 20)
    with tempfile.TemporaryDirectory(prefix="rlplex-elastic-bench-") as tmp:
        figures = run(Path(tmp) / "job", args.ranks, steps, ckpt_every, 0.02, args.kill)
    rows = [
        ("kill -> detected (RESTARTING)", figures["kill_to_detect_s"], "s"),
        ("kill -> re-rendezvous (RUNNING)", figures["kill_to_rerendezvous_s"], "s"),
        ("  of which stopping the survivors' scripts", figures["survivors_stopped_s"], "s"),
        ("  of which waiting for the members", figures["members_gathered_s"], "s"),
        ("  of which the replacement's node check", figures["replacement_checked_s"], "s"),
        ("kill -> training resumed (first step)", figures["kill_to_resumed_s"], "s"),
        ("  of which script start to first step", figures["restart_to_first_step_s"], "s"),
        ("first start: script start to first step", figures["script_start_to_first_step_s"], "s"),
        ("steps lost (redone since the checkpoint)", figures["steps_lost"], f"of every {ckpt_every}"),
        ("final loss", figures["final_loss"], f"after {figures['steps']} steps"),
    ]
    title = f"Elastic recovery: {args.ranks} ranks, 1 {args.kill} SIGKILLed at step {figures['step_at_kill']:g}"
    report("elastic_recovery", title, ["measure", "value", "unit"], rows, figures)


if __name__ == "__main__":
    main()
