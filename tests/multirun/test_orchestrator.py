"""The per-run orchestrator as a real process, driven by a fake trainer written in the test.

The fake trainer plays the trainer's half of the contract: it writes `broadcast/step_0` when
the run appears and `broadcast/step_{s+1}` after it has seen `rollouts/step_s`, each a fresh
random adapter in the PEFT layout, so the rollouts' log-probs tell which adapter made them.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from mr_helpers import snapshot
from torch import nn

from disk_helpers import small_disk
from lm_models import small_tiny_model, tiny_model
from reward_helpers import reward_workers
from rlplex.diagnostics import MetricsLogger
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.errors import RunConfigError
from rlplex.models.hf import load_causal_lm
from rlplex.models.lm import token_logprobs
from rlplex.multirun import OrchestratorConfig, RunDir, apply_multi_lora, orch_config_to_toml, write_peft_adapter
from rlplex.multirun.orchestrator.config import create_run, read_orch_config
from rlplex.multirun.orchestrator.graph import orchestrator_mfcs
from rlplex.multirun.orchestrator.loop import (
    MAX_EMPTY_BATCH_ATTEMPTS,
    MAX_TIMED_OUT_BATCHES,
    WaitOptions,
    main,
    run_orchestrator,
)
from rlplex.multirun.rundir import write_eviction
from rlplex.multirun.rundir.rollouts import ROLLOUT_FILE, read_rollouts, rollouts_ready
from rlplex.multirun.trainer.log import ProgressLog
from timing import scaled, wait_for

TIMEOUT_S = scaled(60.0)
TARGETS = ("q_proj", "v_proj")
RANK, ALPHA = 4, 8.0


def make_config(**overrides: object) -> OrchestratorConfig:
    data: dict[str, object] = {
        "env": {"name": "reverse"},
        "max_steps": 3,
        "batch_size": 16,
        "group_size": 4,
        "max_async_level": 0,
        "model": {"name": str(small_tiny_model()), "lora": {"rank": RANK, "alpha": ALPHA}},
    }
    data.update(overrides)
    return OrchestratorConfig.model_validate(data)


@pytest.fixture
def base_cache() -> Path:
    """The small tiny checkpoint, built once per cache (every process of a test loads it)."""
    return small_tiny_model()


def wait_until(condition: Callable[[], bool], what: str, proc: Orchestrator | None = None) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc is not None and proc.returncode() is not None and not condition():
            raise AssertionError(
                f"orchestrator exited with {proc.returncode()} while waiting for {what}:\n{proc.stderr()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # the polling interval of a condition wait


def _forked_main(argv: list[str], log: str) -> None:
    """Child side of a forked orchestrator: stderr to `log`, the CLI's exit code as ours."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    try:
        code = main(argv)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


class Orchestrators:
    """Starts orchestrator processes with stderr in a file; kills leftovers on teardown.

    `cli=True` runs `python -m rlplex.multirun.orchestrator`; otherwise the process is forked
    from the test process, whose torch and transformers are already imported: a real process
    (its own pid, SIGKILL, exit code) without paying the imports again, which on a loaded
    2-core machine cost more than everything the orchestrator then does.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[Orchestrator] = []

    def start(
        self, out: Path, run_id: str, config: OrchestratorConfig | str, log_name: str, cli: bool = False
    ) -> Orchestrator:
        path = self.tmp_path / f"{run_id}-{log_name}.toml"
        path.write_text(config if isinstance(config, str) else orch_config_to_toml(config))
        log = self.tmp_path / f"{log_name}.log"
        argv = [str(out), run_id, str(path), "--wait-timeout", str(TIMEOUT_S), "--no-tensorboard"]
        if cli:
            with log.open("wb") as handle:
                popen = subprocess.Popen([sys.executable, "-m", "rlplex.multirun.orchestrator", *argv], stderr=handle)
            orch = Orchestrator(log, popen=popen)
        else:
            process = multiprocessing.get_context("fork").Process(target=_forked_main, args=(argv, str(log)))
            process.start()
            orch = Orchestrator(log, process=process)
        self.procs.append(orch)
        return orch

    def close(self) -> None:
        for orch in self.procs:
            if orch.returncode() is None:
                orch.kill()
            orch.wait_exit()


class Orchestrator:
    def __init__(
        self,
        log: Path,
        popen: subprocess.Popen[bytes] | None = None,
        process: multiprocessing.process.BaseProcess | None = None,
    ) -> None:
        self.log, self.popen, self.process = log, popen, process

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def returncode(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        assert self.process is not None
        return self.process.exitcode

    def kill(self) -> None:
        if self.popen is not None:
            self.popen.kill()
        elif self.process is not None:
            self.process.kill()

    def wait_exit(self) -> int:
        if self.popen is not None:
            try:
                return self.popen.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        elif self.process is not None:
            self.process.join(TIMEOUT_S)
        code = self.returncode()
        if code is None:
            raise AssertionError(f"orchestrator still running; stderr:\n{self.stderr()}")
        return code


@pytest.fixture
def orchestrators(tmp_path: Path) -> Iterator[Orchestrators]:
    procs = Orchestrators(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


class FakeTrainer:
    """Writes random adapters to `broadcast/step_N` and remembers them for re-scoring, and, as the
    real trainer does just after each broadcast, the step's row of `logs/trainer_progress.csv`:
    without it a finished orchestrator waits `FINAL_ROW_WAIT_S` (10 s) for that row."""

    def __init__(self, out: Path, run_id: str, config: OrchestratorConfig) -> None:
        self.run = RunDir(out, run_id)
        self.base = load_causal_lm(config.model)  # the orchestrator's weights exactly
        self.model = copy.deepcopy(self.base)
        self.lora = apply_multi_lora(self.model, target_modules=TARGETS, rank=RANK, n_adapters=1)
        self.generator = torch.Generator().manual_seed(7)

    def broadcast(self, step: int) -> None:
        with torch.no_grad():
            for _, param in self.lora.named_parameters_for_adapter(0):
                param.copy_(torch.randn(param.shape, generator=self.generator) * 0.3)
        state = self.lora.adapter_state_dict(0)
        write_peft_adapter(
            self.run.broadcast_step(step), state, self.base.config, rank=RANK, alpha=ALPHA, target_modules=TARGETS
        )
        if step > 0:  # the row of the step trained to make this adapter
            ProgressLog().append(self.run, {"step": step, "time": time.time(), "loss": 0.0})

    def peft_model(self, step: int) -> nn.Module:
        from peft import PeftModel

        return PeftModel.from_pretrained(copy.deepcopy(self.base), str(self.run.broadcast_step(step))).eval()


def new_output(tmp_path: Path, base_cache: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    return out


def start_run(
    orchestrators: Orchestrators, out: Path, run_id: str, config: OrchestratorConfig, log_name: str = "orch"
) -> tuple[Orchestrator, FakeTrainer]:
    orch = orchestrators.start(out, run_id, config, log_name)
    run = RunDir(out, run_id)
    wait_until(run.orch_config.is_file, "control/orch.toml", orch)
    trainer = FakeTrainer(out, run_id, config)
    trainer.broadcast(0)  # what the trainer does when it admits the run
    return orch, trainer


def waiting_line(step: int, at_least: int) -> str:
    return f"step {step} waiting for broadcast step >= {at_least}"


# With max_async_level 1, step 2 waits for broadcast/step_1, but the fake trainer may already
# have written step_2 too when the wait ends: the latest stable broadcast is used.
@pytest.mark.parametrize(("async_level", "expected_policy_steps"), [(0, [{0}, {1}, {2}]), (1, [{0}, {0}, {1, 2}])])
def test_orchestrator_never_runs_ahead_and_records_the_policy(
    tmp_path: Path,
    base_cache: Path,
    orchestrators: Orchestrators,
    async_level: int,
    expected_policy_steps: list[set[int]],
) -> None:
    out = new_output(tmp_path, base_cache)
    config = make_config(max_async_level=async_level)
    orch, trainer = start_run(orchestrators, out, "run_a", config)
    run = trainer.run
    for step in range(config.max_steps):
        wait_until(lambda s=step: rollouts_ready(run, s), f"rollouts/step_{step}", orch)
        blocked = step + async_level + 1
        if blocked < config.max_steps:
            # The orchestrator has reached the step it may not start without broadcast/step_{step+1}...
            wait_until(lambda b=blocked, s=step: waiting_line(b, s + 1) in orch.stderr(), "the wait", orch)
            # ...and has not started it.
            assert not run.rollout_step(blocked).exists()
        trainer.broadcast(step + 1)
    assert orch.wait_exit() == 0, orch.stderr()

    batches = [read_rollouts(run, step, vocab_size=trainer.base.config.vocab_size) for step in range(3)]
    policy_steps = [b.policy_step for b in batches]
    assert all(p in allowed for p, allowed in zip(policy_steps, expected_policy_steps, strict=True)), policy_steps
    for batch in batches:
        assert batch.n == config.batch_size
        assert bool((batch.advantages != 0).any())
        # Re-scored by peft with the adapter the batch names, the sampled tokens have the
        # log-probs the orchestrator recorded: it generated with exactly that adapter.
        with torch.no_grad():
            rescored = token_logprobs(trainer.peft_model(batch.policy_step), batch.tokens, batch.attention)
        mask = batch.loss_mask
        torch.testing.assert_close(rescored[mask], batch.logprobs[mask], atol=2e-4, rtol=0)
    rows = read_metrics_csv(run.root / "progress.csv")
    assert [row["step"] for row in rows] == [0.0, 1.0, 2.0]
    assert [row["charts/policy_lag"] for row in rows] == [s - p for s, p in enumerate(policy_steps)]
    assert all(row["charts/tokens_per_s"] > 0 and 0 <= row["charts/reward_mean"] <= 1 for row in rows)
    # Each step went through the FunctionExecutor: every MFC of the graph has its timings.
    for mfc in orchestrator_mfcs(config.batch_size):
        assert all(row[f"timings/{mfc.name}_run_s"] > 0 and row[f"timings/{mfc.name}_wait_s"] >= 0 for row in rows)
    assert all(row["timings/step_s"] >= row["timings/actor_gen_run_s"] for row in rows)


def test_eviction_file_stops_the_orchestrator_with_the_reason(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    out = new_output(tmp_path, base_cache)
    orch, trainer = start_run(orchestrators, out, "run_e", make_config())
    wait_until(lambda: waiting_line(1, 1) in orch.stderr(), "step 1 to wait for the trainer", orch)
    write_eviction(trainer.run, "malformed rollouts at step 0\n(second line)")  # what evict_run writes
    assert orch.wait_exit() == 3
    last_line = orch.stderr().strip().splitlines()[-1]
    assert last_line == "rlplex orchestrator: run_e evicted: malformed rollouts at step 0 | (second line)"
    assert not trainer.run.rollout_step(1).exists()


def test_evicted_run_raises_runtime_error_in_process(tmp_path: Path) -> None:
    config = make_config()
    out = tmp_path / "out"
    out.mkdir()
    (out / "run_x").mkdir()
    write_eviction(RunDir(out, "run_x"), "run exceeded memory limits")
    with pytest.raises(RuntimeError, match="run_x evicted: run exceeded memory limits"):
        run_orchestrator(out, "run_x", config, wait=WaitOptions(timeout_s=5), tensorboard=False)


def test_self_eviction_after_batches_without_signal(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    out = new_output(tmp_path, base_cache)
    # Greedy decoding gives every completion of a group the same reward: zero advantages.
    orch, trainer = start_run(orchestrators, out, "run_z", make_config(temperature=0.0))
    assert orch.wait_exit() == 3
    reason = trainer.run.eviction_reason() or ""
    assert f"{MAX_EMPTY_BATCH_ATTEMPTS} consecutive batches" in reason and "no learning signal" in reason
    assert orch.stderr().count("no learning signal (all advantages zero)") == MAX_EMPTY_BATCH_ATTEMPTS + 1
    assert not trainer.run.rollouts.exists() or not any(trainer.run.rollouts.iterdir())


def test_rewards_that_keep_timing_out_evict_the_run_naming_reward_and_deadline(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31, hole 2: a reward that never returns (holding the GIL) is killed at the deadline
    and scores 0; batches of nothing but that evict the run with the reason, exit code 3."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # the fork inherits it
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "r:abc>", "answer": "cba"}\n')
    env = {"name": "jsonl", "path": str(data), "reward": "reward_helpers:hold_the_gil", "max_new_tokens": 4}
    out = new_output(tmp_path, base_cache)
    config = make_config(env=env, batch_size=2, group_size=2, reward_timeout_s=1.0)
    orch, trainer = start_run(orchestrators, out, "run_slow", config)
    assert orch.process is not None
    pid = orch.process.pid
    wait_until(lambda: bool(reward_workers(pid)), "a reward worker process of the orchestrator", orch)
    assert orch.wait_exit() == 3, orch.stderr()
    reason = trainer.run.eviction_reason() or ""
    assert "the reward reward_helpers:hold_the_gil of environment 'jsonl' timed out" in reason
    assert f"(reward_timeout_s = 1 s) on at least half the rows of {MAX_TIMED_OUT_BATCHES} consecutive" in reason
    assert "2 of 2 in the last (step 0)" in reason
    assert orch.stderr().strip().splitlines()[-1] == f"rlplex orchestrator: run_slow evicted: {reason}"
    wait_for(lambda: not reward_workers(pid), 10, "the orchestrator's reward workers to end")


def test_a_run_folder_that_refuses_writes_evicts_its_run_alone_with_the_error(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    """Issue 31, hole 4: a read-only run folder used to crash the orchestrator at every restart
    until the job's budget was spent. The run evicts itself, its reason beside the runs (the
    folder refuses control/evicted.txt too), exit code 3: the node ends without a restart."""
    out = new_output(tmp_path, base_cache)
    config = make_config()
    run = create_run(out, "run_ro", config)  # a restart: the folder was made before it turned read-only
    FakeTrainer(out, "run_ro", config).broadcast(0)
    with small_disk(run.root) as disk:
        disk.read_only()
        orch = orchestrators.start(out, "run_ro", config, "orch")
        assert orch.wait_exit() == 3, orch.stderr()
        reason = run.unwritten_eviction() or ""
        assert "its run folder refuses writes" in reason and "Read-only file system" in reason, reason
        last = orch.stderr().strip().splitlines()[-1]
        assert last.startswith("rlplex orchestrator: run_ro evicted: orchestrator self-evicted: its run folder"), last
        assert not run.is_evicted() and not run.rollouts.exists()


def test_restart_after_sigkill_resumes_without_regenerating(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    out = new_output(tmp_path, base_cache)
    config = make_config()
    orch, trainer = start_run(orchestrators, out, "run_k", config, "first")
    run = trainer.run
    wait_until(lambda: waiting_line(1, 1) in orch.stderr(), "step 1 to wait for the trainer", orch)
    orch.kill()  # SIGKILL
    assert orch.wait_exit() == -signal.SIGKILL
    step0 = run.rollout_step(0) / ROLLOUT_FILE
    before = os.stat(step0)
    # A step the crash left half-written: files but no STABLE marker.
    (run.rollout_step(1)).mkdir()
    (run.rollout_step(1) / ROLLOUT_FILE).write_bytes(b"truncated")

    orch = orchestrators.start(out, "run_k", config, "second")
    wait_until(lambda: "resuming at step 1" in orch.stderr(), "the restart to resume", orch)
    for step in (1, 2):
        trainer.broadcast(step)
        wait_until(lambda s=step: rollouts_ready(run, s), f"rollouts/step_{step}", orch)
    trainer.broadcast(3)
    assert orch.wait_exit() == 0, orch.stderr()
    after = os.stat(step0)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [read_rollouts(run, s).policy_step for s in (1, 2)] == [1, 2]
    rows = read_metrics_csv(run.root / "progress.csv")
    assert [row["step"] for row in rows] == [0.0, 1.0, 2.0]


def test_links_planted_in_the_run_folder_change_nothing_outside_nor_lend_another_runs_adapter(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    """Issue 31, hole 5, as a whole process: `progress.csv.tmp` linked to another run's progress.csv
    and `broadcast/step_5` linked to that run's newest adapter (the other links: `test_run_links`)."""
    out = new_output(tmp_path, base_cache)
    config = make_config(max_steps=2)
    other = FakeTrainer(out, "run_b", config)
    other.generator.manual_seed(99)  # weights of its own, unlike run_a's
    create_run(out, "run_b", config)
    other.broadcast(5)
    with MetricsLogger(other.run.root, tensorboard=False) as metrics:
        for step in range(23):
            metrics.log(step, {"charts/reward_mean": step / 23})
    before = snapshot(other.run.root)

    orch = orchestrators.start(out, "run_a", config, "orch")
    run = RunDir(out, "run_a")
    # Planted while it waits for its first adapter: what it picks next is what it samples with.
    wait_until(lambda: waiting_line(0, 0) in orch.stderr(), "step 0 to wait for the trainer", orch)
    (run.root / "progress.csv.tmp").symlink_to(other.run.root / "progress.csv")
    run.ensure_dir("broadcast")
    (run.broadcast / "step_5").symlink_to(other.run.broadcast_step(5), target_is_directory=True)
    trainer = FakeTrainer(out, "run_a", config)
    trainer.broadcast(0)
    for step in range(config.max_steps):
        wait_until(lambda s=step: rollouts_ready(run, s), f"rollouts/step_{step}", orch)
        trainer.broadcast(step + 1)
    assert orch.wait_exit() == 0, orch.stderr()

    assert snapshot(other.run.root) == before
    batches = [read_rollouts(run, step) for step in range(config.max_steps)]
    assert [batch.policy_step for batch in batches] == [0, 1]
    for batch in batches:  # sampled with run_a's own adapter of that step, not with run_b's
        with torch.no_grad():
            rescored = token_logprobs(trainer.peft_model(batch.policy_step), batch.tokens, batch.attention)
        torch.testing.assert_close(rescored[batch.loss_mask], batch.logprobs[batch.loss_mask], atol=2e-4, rtol=0)
    rows = read_metrics_csv(run.root / "progress.csv")
    assert [(row["step"], row["charts/policy_step"]) for row in rows] == [(0.0, 0.0), (1.0, 1.0)]
    assert (run.root / "progress.csv.tmp").is_symlink()  # left alone: it is not a name rlplex writes


@pytest.mark.slow
def test_bad_orch_toml_is_refused_naming_the_field(
    tmp_path: Path, base_cache: Path, orchestrators: Orchestrators
) -> None:
    out = tmp_path / "out"
    body = 'env = { name = "reverse" }\nmax_steps = 3\nbatch_size = 6\ngroup_size = 4\n'
    body += f'[model]\nname = "{base_cache}"\n'
    orch = orchestrators.start(out, "run_bad", body, "bad", cli=True)
    assert orch.wait_exit() == 2
    message = orch.stderr()
    assert "run_bad-bad.toml" in message and "field 'group_size'" in message and "not a multiple" in message
    assert not (out / "run_bad").exists()


@pytest.mark.slow
def test_unknown_env_and_changed_config_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "orch.toml"
    body = f'env = {{ name = "juggle" }}\nmax_steps = 3\nbatch_size = 4\n[model]\nname = "{tiny_model()}"\n'
    path.write_text(body)
    assert main([str(tmp_path / "out"), "run_t", str(path)]) == 2
    assert "'juggle'" in capsys.readouterr().err
    with pytest.raises(RunConfigError, match=r"another config \(seed: 0 -> 5\).*frozen"):
        out = tmp_path / "out2"
        out.mkdir()
        config = make_config()
        run = RunDir(out, "run_c")
        (out / "run_c").mkdir()
        run.write_text(run.orch_config, orch_config_to_toml(config))
        run.write_text(run.rollout_step(0) / "STABLE", "")
        run_orchestrator(out, "run_c", make_config(seed=5), WaitOptions(timeout_s=1), tensorboard=False)


def test_example_config_is_valid() -> None:
    config = read_orch_config(Path(__file__).parents[2] / "examples" / "multirun_orch.toml")
    assert (config.env.name, config.batch_size, config.group_size, config.max_async_level) == ("reverse", 64, 8, 1)
    assert config.model.name == "outputs/models/tiny-reverse"


def test_the_evaluator_scores_fixed_examples_and_skips_what_a_restart_already_evaluated(
    tmp_path: Path, base_cache: Path
) -> None:
    from rlplex.models.hf import load_tokenizer
    from rlplex.multirun.orchestrator.evaluator import RunEvaluator

    out = new_output(tmp_path, base_cache)
    config = make_config(max_steps=7, evaluation={"every": 3, "examples": 6, "temperatures": [0.0]})
    run = create_run(out, "run_v", config)
    tokenizer = load_tokenizer(config.model)

    class Echo:  # the actor's engine answers every prompt with its own text: a fixed, checkable reply
        def complete(self, step: int, prompts: list[list[int]], temperature: float, seed: int, n: int) -> list[str]:
            return [tokenizer.decode(p) for p in prompts]

    evaluator = RunEvaluator(run, config, tokenizer, tensorboard=False)
    assert [evaluator.due(s) for s in range(8)] == [True] * 8  # nothing evaluated yet
    (result,) = evaluator.evaluate(Echo(), 0)  # type: ignore[arg-type]
    assert result.n == 6 and result.temperature == 0.0 and 0 <= result.accuracy <= result.reward <= 1
    assert [evaluator.due(s) for s in range(1, 8)] == [False, False, True, True, True, True, True]
    evaluator.evaluate(Echo(), 4)  # type: ignore[arg-type]
    evaluator.close()
    again = RunEvaluator(run, config, tokenizer, tensorboard=False)  # a restarted orchestrator
    assert again.examples == evaluator.examples and again.done == {0, 4}
    assert [again.due(s) for s in (4, 5, 6, 7)] == [False, False, True, True]
    again.close()
