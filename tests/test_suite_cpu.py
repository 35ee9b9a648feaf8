"""benchmarks.suite_cpu: the kinds the suite's processes are counted under, and a real sample."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.suite_cpu import CpuSampler, kind_of

from timing import scaled, wait_for


def test_each_kind_of_process_is_named_before_the_pytest_paths_in_its_command_line() -> None:
    tmp = "/tmp/pytest-of-root/pytest-3/popen-gw0/test_x0/out"
    assert kind_of(f"python -m rlplex.control.node.runtime --output-dir {tmp}") == "nodes"
    assert kind_of(f"python -m vllm.entrypoints.openai.api_server --model {tmp}/m") == "vLLM servers"
    assert kind_of(f"python -m rlplex.cli train {tmp}/cp.toml") == "rlplex CLI processes"
    assert kind_of("[pytest-xdist idle]") == "pytest workers (test bodies, in-process masters)"
    assert kind_of("python") == "python processes named by setproctitle (forked children)"
    assert kind_of("/usr/sbin/sshd -D") == "other"


def test_a_child_that_burns_cpu_is_counted_with_its_cpu_time() -> None:
    # The child burns 0.4 CPU-s, then waits on its stdin until the sampler has seen it whole.
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nsys.stdin.read()"
    with CpuSampler(interval=0.05) as sampler:
        child = subprocess.Popen([sys.executable, "-c", burn, "suite-cpu-probe"], stdin=subprocess.PIPE)
        try:

            def probes() -> list[float]:
                return [cpu for cpu, command in list(sampler.seen.values()) if "suite-cpu-probe" in command]

            wait_for(lambda: any(cpu >= 0.35 for cpu in probes()), 30, "the sampler to see the child's CPU")
        finally:
            child.communicate(timeout=30)
    (seen,) = probes()
    assert 0.35 <= seen <= 5.0
    assert sampler.by_kind()["other"]["cpu_s"] >= seen


def test_cpu_top_charges_each_test_its_own_and_its_childrens_cpu(tmp_path: Path) -> None:
    """`--cpu-top` (tests/cpu_report.py) in a pytest run of its own: a test whose child process
    burns 0.5 CPU-s is listed first, with at least that, and a test that only sleeps after it."""
    (tmp_path / "test_inner.py").write_text(
        "import subprocess, sys, time\n"
        "BURN = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass'\n"
        "def test_burns_in_a_child():\n"
        "    subprocess.run([sys.executable, '-c', BURN], check=True)\n"
        "def test_sleeps():\n"
        "    time.sleep(0.3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    inner = ["-q", "-p", "cpu_report", "-p", "no:cacheprovider", "--cpu-top=2", "test_inner.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *inner],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.rstrip().endswith(("_child", "_sleeps"))]
    assert [line[-1].rsplit("::", 1)[1] for line in lines] == ["test_burns_in_a_child", "test_sleeps"], done.stdout
    assert float(lines[0][0]) >= 0.5 > float(lines[1][0]), done.stdout
    assert "2 most CPU-costly tests (all 2: " in done.stdout
