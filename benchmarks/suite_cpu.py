"""Where the test suite's CPU goes: runs a command (by default what `make test` runs) while it
samples every process on the machine, then prints CPU-seconds by kind of process.

The suite is CPU-bound on two cores (its wall time is about its CPU-seconds over two), and
pytest's `--durations` are wall times: a test that waits on its own processes looks expensive
there but costs the suite only its CPU. This table says which processes to make cheaper.

    python -m benchmarks.suite_cpu                      # the whole suite
    python -m benchmarks.suite_cpu -- pytest -q tests/control   # any command

Every `interval` seconds, psutil's view of each process is read; a process (pid and creation
time) counts with the largest user + system time seen for it, so one that lived between two
samples is missed (the counts are a floor). Writes bench_results/suite_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import psutil

PYTEST = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]

# First match wins: the specific kinds before "pytest", whose temporary paths appear in many
# children's command lines.
KINDS: tuple[tuple[str, str], ...] = (
    (r"elastic\.entry", "elastic scripts (trainer ranks)"),
    (r"elastic\.check", "elastic node checks"),
    (r"node\.runtime", "nodes"),
    (r"forker", "fork servers"),
    (r"vllm|VLLM|EngineCore|APIServer", "vLLM servers"),
    (r"raylet|gcs_server|ray::|/ray/|default_worker|log_monitor", "Ray"),
    (r"rlplex\.cli|bin/rlplex", "rlplex CLI processes"),
    (r"multirun\.trainer|multirun\.orchestrator", "multi-run trainer and orchestrator processes"),
    (r"reward_guard", "reward workers"),
    (r"chrom", "chromium"),
    (r"multiprocessing", "multiprocessing children"),
    (r"xdist|pytest", "pytest workers (test bodies, in-process masters)"),
    (r"^python\S*$", "python processes named by setproctitle (forked children)"),
)


def kind_of(command_line: str) -> str:
    for pattern, kind in KINDS:
        if re.search(pattern, command_line):
            return kind
    return "other"


class CpuSampler:
    """A thread that keeps each process's largest CPU time until stopped (this process excluded)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.seen: dict[tuple[int, float], tuple[float, str]] = {}
        # What the processes that were already running had used: only what they use meanwhile counts.
        self.before: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._sample()
        self.before = {key: cpu for key, (cpu, _command) in self.seen.items()}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()
        self._sample()

    def _sample(self) -> None:
        me = os.getpid()
        for process in psutil.process_iter(["cmdline", "cpu_times", "create_time", "name"]):
            info = process.info
            if process.pid == me or info["cpu_times"] is None:
                continue
            cpu = info["cpu_times"].user + info["cpu_times"].system
            key = (process.pid, info["create_time"])
            known_cpu, known_command = self.seen.get(key, (-1.0, ""))
            # A zombie has no command line left: keep the one it had while it ran.
            command = " ".join(info["cmdline"] or []) or known_command or info["name"] or "?"
            if cpu >= known_cpu:
                self.seen[key] = (cpu, command)

    def by_kind(self) -> dict[str, dict[str, float]]:
        kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_s": 0.0, "processes": 0})
        for key, (cpu, command) in self.seen.items():
            used = cpu - self.before.get(key, 0.0)
            if used <= 0.0:
                continue
            entry = kinds[kind_of(command)]
            entry["cpu_s"] += used
            entry["processes"] += 1
        return dict(sorted(kinds.items(), key=lambda item: -item[1]["cpu_s"]))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs="*", help="the command to run (default: the whole suite as make test)")
    args = parser.parse_args(argv)
    command = args.command or PYTEST
    started = time.perf_counter()
    with CpuSampler(args.interval) as sampler:
        code = subprocess.call(command)
    wall = time.perf_counter() - started
    kinds = sampler.by_kind()
    total = sum(entry["cpu_s"] for entry in kinds.values())
    rows: list[list[Any]] = [[kind, entry["cpu_s"], int(entry["processes"])] for kind, entry in kinds.items()]
    rows.append(["all", total, sum(int(entry["processes"]) for entry in kinds.values())])
    figures = {"command": command, "exit_code": code, "wall_s": wall, "cpu_s": total, "kinds": kinds}
    report(
        "suite_cpu",
        f"CPU by process kind: {total:,.0f} CPU-s in {wall:,.0f} s wall",
        ["kind", "CPU-s", "n"],
        rows,
        figures,
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
