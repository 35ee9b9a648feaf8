"""End to end, every part a real process: one trainer (`python -m rlplex.multirun.trainer
--max-runs 2`) and one orchestrator process per run (the orchestrator CLI's `main`, forked from
the test process as in test_orchestrator.py: on a loaded 2-core machine three more imports of
torch and transformers take longer than the whole test otherwise does).

run_a is evicted mid-way by its user (`control/evicted.txt`, as `rlplex runs evict` writes it);
run_b trains its `max_steps` and is marked finished, which frees its slot; run_c, added while
both slots were taken, waits, then trains in run_b's slot to the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_orchestrator import Orchestrator, Orchestrators, make_config, new_output

from rlplex.multirun import RunDir, create_run
from rlplex.multirun.rundir import STABLE_MARKER, stable_steps, write_eviction
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.trainer.log import read_progress_csv
from timing import scaled

pytestmark = pytest.mark.e2e

SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = scaled(60.0)
BATCH = 16  # four groups of four: a batch with no learning signal (which the orchestrator draws again) is rare
CONFIGS = {
    "run_a": make_config(max_steps=40, batch_size=BATCH, seed=1),  # never reaches its end: evicted
    "run_b": make_config(max_steps=4, batch_size=BATCH, seed=2),
    "run_c": make_config(max_steps=3, batch_size=BATCH, seed=3),
}
REASON = "evicted by its user mid-way (test)"


@pytest.fixture
def base_cache() -> Path:
    return Path(CONFIGS["run_a"].model.name)


def start_trainer(out: Path, log: Path, model: str, max_runs: int = 2) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    args = ["--output-dir", str(out), "--max-runs", str(max_runs), "--model", model, "--checkpoint-every", "1"]
    with log.open("wb") as handle:  # a file, not a pipe: a full pipe would block the trainer's logging
        return subprocess.Popen(
            [sys.executable, "-m", "rlplex.multirun.trainer", *args, "--threads", "1"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


@contextmanager
def trainer_and_orchestrators(
    tmp_path: Path, out: Path, model: str, max_runs: int = 2
) -> Iterator[tuple[subprocess.Popen[bytes], Path, Orchestrators]]:
    """A trainer process and an orchestrator starter; both are cleaned up, also on failure."""
    log = tmp_path / "trainer.log"
    trainer = start_trainer(out, log, model, max_runs)
    orchestrators = Orchestrators(tmp_path)
    try:
        yield trainer, log, orchestrators
    finally:
        orchestrators.close()
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()


def stop_trainer(out: Path, trainer: subprocess.Popen[bytes], log: Path) -> None:
    """What the conductor does at the end (through its ElasticWorker): SIGTERM, then a clean exit."""
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=TIMEOUT_S) == 0, log.read_text()


def mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_evicted_finished_and_added_runs_share_one_trainer_with_two_slots(tmp_path: Path, base_cache: Path) -> None:
    out = new_output(tmp_path, base_cache)
    runs = {name: RunDir(out, name) for name in CONFIGS}
    procs: dict[str, Orchestrator] = {}
    allowed_exit: dict[str, int] = {}  # 0 (done) unless said otherwise

    def wait(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if trainer.poll() is not None:
                raise AssertionError(
                    f"trainer exited {trainer.returncode} waiting for {what}:\n{trainer_log.read_text()}"
                )
            for name, proc in procs.items():
                if proc.returncode() not in (None, allowed_exit.get(name, 0)) and not condition():
                    raise AssertionError(f"{name}'s orchestrator exited {proc.returncode()} waiting for {what}:\n"
                                         f"{proc.stderr()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {TIMEOUT_S} s waiting for {what}:\n{trainer_log.read_text()}")
            time.sleep(0.02)  # the polling interval of a condition wait

    with trainer_and_orchestrators(tmp_path, out, str(base_cache)) as (trainer, trainer_log, orchestrators):
        for name in ("run_a", "run_b"):
            procs[name] = orchestrators.start(out, name, CONFIGS[name], name)
        wait(lambda: all(is_stable_adapter(runs[n].broadcast_step(1)) for n in ("run_a", "run_b")), "a step of each")
        # run_c is added while both slots are taken (run_b has 3 steps to go): its orch.toml first,
        # as its orchestrator writes it, then its orchestrator.
        create_run(out, "run_c", CONFIGS["run_c"])
        added = mtime(runs["run_c"].orch_config)
        assert not runs["run_b"].is_finished()
        procs["run_c"] = orchestrators.start(out, "run_c", CONFIGS["run_c"], "run_c")
        wait(lambda: is_stable_adapter(runs["run_c"].broadcast_step(0)), "run_c to be admitted")
        # It waited: admitted (broadcast/step_0 written at admission) only after run_b was marked finished.
        assert runs["run_b"].finished_step() == 4
        assert added < mtime(runs["run_b"].finished) <= mtime(runs["run_c"].broadcast_step(0) / STABLE_MARKER)
        assert not runs["run_a"].is_evicted() and not runs["run_a"].is_finished()  # the slot was run_b's

        allowed_exit["run_a"] = 3
        write_eviction(runs["run_a"], REASON)  # what `rlplex runs evict` and the trainer's evict_run write
        assert procs["run_a"].wait_exit() == 3, procs["run_a"].stderr()
        assert procs["run_b"].wait_exit() == 0, procs["run_b"].stderr()
        assert procs["run_c"].wait_exit() == 0, procs["run_c"].stderr()
        wait(runs["run_c"].is_finished, "run_c to be marked finished")
        stop_trainer(out, trainer, trainer_log)

    log = trainer_log.read_text()
    assert "Traceback" not in log, log
    assert (
        f"run run_a is evicted ({REASON}); slot" in log and "run run_b is finished (finished: trained 4 steps)" in log
    )
    # run_a: evicted with the reason, mid-way; its orchestrator reported it and stopped.
    assert runs["run_a"].eviction_reason() == REASON
    assert procs["run_a"].stderr().strip().splitlines()[-1] == f"rlplex orchestrator: run_a evicted: {REASON}"
    a_steps = [int(r["step"]) for r in read_progress_csv(runs["run_a"])]
    assert 1 <= len(a_steps) < CONFIGS["run_a"].max_steps and not runs["run_a"].is_finished()
    assert a_steps == list(range(1, len(a_steps) + 1))  # no step trained twice
    # run_b and run_c: every step trained once, checkpointed and broadcast; marked finished.
    slots = {}
    for name in ("run_b", "run_c"):
        run, max_steps = runs[name], CONFIGS[name].max_steps
        rows = read_progress_csv(run)
        assert [int(r["step"]) for r in rows] == list(range(1, max_steps + 1)), name
        assert rows[-1]["total_samples"] == BATCH * max_steps, name
        # Retention (the default keeps the newest 3 checkpoints) pruned the older ones.
        assert [step for step, _ in stable_steps(run.checkpoints)] == list(range(1, max_steps + 1))[-3:], name
        assert [step for step, _ in stable_steps(run.broadcast)] == list(range(max_steps + 1)), name
        assert run.finished_step() == max_steps, name
        slots[name] = {int(r["slot"]) for r in rows}
    assert slots["run_c"] == slots["run_b"] and len(slots["run_b"]) == 1  # run_c took run_b's slot
    assert mtime(runs["run_c"].finished) >= mtime(runs["run_c"].checkpoint_step(3) / STABLE_MARKER)


USER_REWARD = '''
def varied(prompt: str, completion: str, answer: str) -> float:
    """Rewards completions made of many different characters: random text varies, so groups do too."""
    return len(set(completion)) / (1 + len(completion))
'''


def test_an_independent_llama_trains_a_user_chat_dataset_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer and orchestrator processes on a second checkpoint (another architecture, tokenizer
    and chat template) with a user's JSONL file of chat messages and a reward named by dotted path."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lm_models import random_llama
    from rlplex.multirun import OrchestratorConfig

    llama = str(random_llama())
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "user_rewards_e2e.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path / "user"))  # the forked orchestrator inherits sys.path
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"say {n} things"}], "answer": str(n)} for n in range(12)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {"name": "jsonl", "path": str(data), "messages_field": "messages", "reward": "user_rewards_e2e:varied"}
    config = OrchestratorConfig.model_validate(
        {
            "env": {**env, "max_new_tokens": 6},
            "max_steps": 3,
            "batch_size": 8,
            "group_size": 4,
            "max_async_level": 0,
            "model": {"name": llama, "lora": {"rank": 4, "alpha": 8.0}},
        }
    )
    out = tmp_path / "out"
    out.mkdir()
    run = RunDir(out, "run_llama")
    with trainer_and_orchestrators(tmp_path, out, llama, max_runs=1) as (trainer, trainer_log, orchestrators):
        orch = orchestrators.start(out, "run_llama", config, "run_llama")
        assert orch.wait_exit() == 0, orch.stderr() + trainer_log.read_text()
        deadline = time.monotonic() + TIMEOUT_S
        while not run.is_finished():
            assert trainer.poll() is None, trainer_log.read_text()
            assert time.monotonic() < deadline, "run_llama was not marked finished"
            time.sleep(0.02)  # the polling interval of a condition wait
        stop_trainer(out, trainer, trainer_log)
    assert [int(r["step"]) for r in read_progress_csv(run)] == [1, 2, 3]
    broadcast = run.broadcast_step(3)
    assert json.loads((broadcast / "adapter_config.json").read_text())["base_model_name_or_path"] == llama
    # peft loads the trained adapter over the checkpoint it names, and the adapter changes the model.
    import torch

    base = AutoModelForCausalLM.from_pretrained(llama).eval()
    tokens = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        plain = base(tokens).logits
        tuned = PeftModel.from_pretrained(base, str(broadcast)).eval()(tokens).logits
    assert not torch.allclose(plain, tuned)
