"""The main job end to end with a tiny budget: every process real (PrimeMaster, an elastic trainer
rank, orchestrators, rollout nodes, conductor); a run added and a run evicted by the
job's events, and a run the trainer rejects, which ends alone while the job goes on; the
master serves the dashboard meanwhile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from mainjob_helpers import run_config, tiny_job
from rich.console import Console

from lm_models import small_tiny_model
from node_helpers import job_processes
from rlplex.config import load_config
from rlplex.control.job.states import JobState
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect
from rlplex.multirun.export import export_run
from timing import scaled, wait_for
from tracker_files import history, run_record, tensorboard_scalars

pytestmark = pytest.mark.e2e

EVENTS = """
[[events]]
when = { run = "run_a", step = 1 }
add_run = "run_c"
[[events]]
when = { run = "run_b", step = 1 }
evict_run = "run_b"
reason = "evicted on purpose by the test"
"""


DASHBOARD = """
[dashboard]
enabled = true
"""


class DashboardWatcher(threading.Thread):
    """Finds the dashboard's link in the job's console, then polls its JSON until a run has
    trained a step (or the job's dashboard is gone)."""

    def __init__(self, console: Path) -> None:
        super().__init__(daemon=True)
        self.console, self.url, self.error = console, "", ""
        self.refused: list[int] = []
        self.seen: list[dict[str, int]] = []
        self.doing: set[str] = set()  # what the runs' orchestrators said they were doing
        self.trained = False

    def run(self) -> None:
        try:
            found = wait_for(lambda: "token=" in self.console.read_text(), 240, "the dashboard's link")
            assert found
            self.url = "http" + self.console.read_text().split(": http", 1)[1].split()[0]
            base = self.url.split("/?")[0]
            self.refused = [httpx.get(f"{base}{path}").status_code for path in ("/", "/api/view")]
            with httpx.Client() as web:
                web.get(self.url)  # the link's cookie
                while not self.trained:
                    runs = web.get(f"{base}/api/view").json()["runs"]
                    self.seen.append({run["id"]: run["step"] for run in runs})
                    self.doing.update(run["doing"] for run in runs if run["doing"])
                    self.trained = any(run["step"] >= 1 for run in runs)
                    time.sleep(0.2)
        except (AssertionError, httpx.HTTPError, ValueError, KeyError) as error:
            self.error = repr(error)


def test_main_job_runs_end_to_end_with_an_added_an_evicted_and_a_rejected_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    runs = {
        # run_a is evaluated on fixed examples, greedy and sampled: at policy step 0, once among steps
        # 2..3 (the first it sees: it runs a step ahead), and at 3, its last.
        # run_a also has an offline W&B run (its own [logging] beside the job's TensorBoard).
        "run_a": run_config(1, 3, "evaluation = { every = 2, examples = 8 }, logging = { wandb = true }"),
        "run_b": run_config(2, 30, "optim = { lr = 3e-3 }"),
        "run_wide": run_config(4, 2, "model = { lora = { rank = 16 } }"),  # above the trainer's rank
    }
    # run_c generates on two nodes of the job's rollout role, which grows when run_c joins.
    later = {"run_c": run_config(3, 2, "rollout_workers = 2")}
    # The master serves the dashboard (`[dashboard] enabled`): a thread beside the job reads it.
    path.write_text(tiny_job("mj-e2e", out, runs, later, rest=EVENTS + DASHBOARD, world_size=1))
    watcher = DashboardWatcher(tmp_path / "console.txt")
    try:
        # Without the preflight (which would refuse run_wide before anything starts: see
        # test_main_job_user_holes.py): the trainer itself judges each run when it discovers it.
        console = Console(file=open(tmp_path / "console.txt", "w"))
        watcher.start()
        state = run_main_job(load_config(MainJobConfig, path), console, live=False, check_runs=False)
        watcher.join(scaled(30))
        # While the job ran, its master served the page's JSON to the token alone, and the runs in it.
        assert watcher.refused == [401, 401] and watcher.trained, (watcher.error, watcher.seen[-3:])
        # Before its first step, a run's row said what its orchestrator did (its heartbeat's phase).
        assert watcher.doing & {"loading the model", "generating step 0"}, watcher.doing
        printed = (tmp_path / "console.txt").read_text()
        assert printed.count("token=") == 1  # the link, printed once
        # Without a live view, a line per run as it changes: run_a's last says its held-out score.
        assert re.search(r"run_a +finished +step 3/3 .* held-out \d\.\d{3}", printed), printed
        with pytest.raises(httpx.ConnectError):  # and stopped serving with the job
            httpx.get(watcher.url)
        assert state == JobState.STOPPED, (out / "report.md").read_text()
        runs = {run.run_id: run for run in collect(out).runs}
        assert set(runs) == {"run_a", "run_b", "run_c", "run_wide"}
        # The rejected run ended alone, with the reason, and its orchestrator was never restarted.
        assert runs["run_wide"].state == "rejected"
        assert "model.lora.rank" in runs["run_wide"].reason and "16" in runs["run_wide"].reason
        orchestrators = [node for node in collect(out).nodes if node.role == "orchestrator"]
        assert len(orchestrators) == 4 and all(node.restarts == 0 for node in orchestrators), orchestrators
        # Three runs beside one trainer rank: an orchestrator that generates gets no more than the
        # core the rank leaves (generation_threads), not torch's every core.
        assert "run_a: 1 torch threads" in (out / "logs" / "orchestrator-0.log").read_text()
        assert runs["run_a"].state == runs["run_c"].state == "finished"
        assert runs["run_a"].trained_steps == 3 and runs["run_c"].trained_steps == 2
        assert runs["run_b"].state == "evicted" and runs["run_b"].reason == "evicted on purpose by the test"
        assert runs["run_b"].trained_steps < 30  # the others carried on without it
        view = collect(out)
        rollout = [node for node in view.nodes if node.role == "rollout"]
        assert sorted(node.rank for node in rollout) == [0, 1] and view.rollout_runs == ["run_c", "run_c"]
        assert all(node.progress.get("calls", 0) >= 1 for node in rollout), [n.progress for n in rollout]
        report = (out / "report.md").read_text()
        for section in (
            "## Runs",
            "## Learning curves",
            "## Nodes and restarts",
            "## Evictions",
            "tokens/s",
            "rejected",
        ):
            assert section in report, section
        evaluations = runs["run_a"].evaluations
        assert [row["step"] for row in evaluations] in ([0.0, 2.0, 3.0], [0.0, 3.0]), evaluations
        assert all(0 <= row["eval/accuracy_t0"] <= row["eval/reward_t0"] <= 1 for row in evaluations)
        assert all("eval/accuracy_t1" in row for row in evaluations) and not runs["run_c"].evaluations
        assert "## Held-out evaluation" in report and f"| run_a | {len(evaluations)} | 0..3 |" in report
        for png in ("rewards.png", "run_a.png", "run_c.png", "heldout.png"):
            assert (out / "plots" / png).stat().st_size > 1000
        # Each run's trackers got every metric: its rollouts', the trainer's rows of it, its evaluations.
        scalars = tensorboard_scalars(out / "tb" / "run_a")
        assert [step for step, _ in scalars["charts/reward_mean"]] == [0, 1, 2]
        for tag in ("trainer/loss", "trainer/grad_norm", "trainer/lr", "trainer/stale_dropped"):
            assert [step for step, _ in scalars[tag]] == [1, 2, 3], (tag, scalars.get(tag))
        assert [step for step, _ in scalars["eval/accuracy_t0"]] == [row["step"] for row in evaluations]
        assert "trainer/loss" in tensorboard_scalars(out / "tb" / "run_c")
        (wandb_file,) = (out / "wandb").glob("offline-run-*-mj-e2e-run_a/run-*.wandb")
        logged = history(wandb_file)
        assert {row["step"] for row in logged if "trainer/loss" in row} == {1, 2, 3}
        assert run_record(wandb_file).run_group == "mj-e2e" and not list((out / "wandb").glob("*run_c*"))
        # `rlplex export`: the run's last adapter leaves the job as a folder peft loads onto the base.
        exported = export_run(out, "run_a", tmp_path / "run_a-adapter")
        assert exported.step == 3
        from peft import PeftModel
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(small_tiny_model()), str(exported.dest))
        weights, state = load_file(exported.dest / "adapter_model.safetensors"), loaded.state_dict()
        peft_name = {key: key.replace(".weight", ".default.weight") for key in weights}
        assert weights and all(torch.equal(state[peft_name[key]], value) for key, value in weights.items())
    finally:
        _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def test_main_job_trains_pretrained_smollm2_on_the_quickstart_example(tmp_path: Path) -> None:
    """The README's quickstart from Python, `examples/my_data/train.py` (the same job as its
    `job.toml`, which `rlplex check` checks in tests/test_readme_commands.py and
    tests/mainjob/test_api.py holds equal to this one): a `datasets.Dataset` of chat messages
    written into the job's folder, the reward of `my_data/my_reward.py` imported by the job's
    processes through the script's path, `run_job`'s results and the merged export. It runs
    `rlplex run`'s whole path (an elastic trainer rank, an orchestrator node, the conductor) on a
    real pretrained model, SmolLM2-135M-Instruct converted from its GGUF package: another
    architecture (Llama), tokenizer and chat template (with a default system prompt) than the tiny
    model's. Two steps: the second trains on the first broadcast adapter, which is all a longer
    run adds here."""
    from lm_models import smollm2

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    script = [sys.executable, str(root / "examples" / "my_data" / "train.py"), "--model", str(smollm2())]
    budget = ["--output", str(out), "--steps", "2", "--batch-size", "4", "--max-new-tokens", "8"]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    try:
        done = subprocess.run(
            [*script, *budget], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(400)
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "FINISHED: run_mine trained 2 steps, reward " in done.stdout, done.stdout
        (run,) = collect(out).runs
        assert (run.run_id, run.state, run.trained_steps) == ("run_mine", "finished", 2)
        rows = (out / "data" / "run_mine.jsonl").read_text().splitlines()
        assert len(rows) == 24 and json.loads(rows[0])["messages"][0]["role"] == "user"
        adapter = json.loads((out / "runs" / "run_mine" / "broadcast" / "step_2" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(smollm2())
        assert adapter["target_modules"] and adapter["r"] == 8
        # The merged export: the base's weights plus the run's adapter, a plain model folder.
        assert f"model: {out / 'model'}" in done.stdout
        from safetensors import safe_open

        key = "model.layers.0.self_attn.q_proj.weight"
        with safe_open(str(out / "model" / "model.safetensors"), "pt") as merged:
            with safe_open(str(smollm2() / "model.safetensors"), "pt") as base:
                assert not torch.equal(merged.get_tensor(key), base.get_tensor(key))
    finally:
        _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
