"""The asynchronous GRPO runner under asynchrony and faults (issue 17): the staleness bound
with several rollout workers and a straggler, decoupled PPO, checkpoint and resume."""

from __future__ import annotations

import collections
import csv
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lm_models import small_tiny_model, untrained_tiny_model
from rlplex.algos.grpo import grpo_loss
from rlplex.io.snapshot import latest_snapshot, read_snapshot
from rlplex.runners import grpo_lm
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm
from timing import scaled


def _config(**overrides: Any) -> GRPOLMConfig:
    settings: dict[str, Any] = {
        "model": {"name": str(untrained_tiny_model())},
        "batch_size": 8,
        "group_size": 4,
        "eval_samples": 8,
        "rollout_workers": 2,
        **overrides,
    }
    settings.setdefault("eval_every", settings.get("steps", 60))
    return GRPOLMConfig.model_validate(settings)


def test_a_straggler_started_long_ago_is_never_trained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0's first group is held back until the trainer is eta + 2 versions ahead; the
    other workers keep the trainer fed. That group must be dropped (and counted), not trained."""
    eta, release_at = 1, 3
    released = threading.Event()
    make_worker = grpo_lm._make_rollout_worker

    def make_with_a_straggler(index: int, config: GRPOLMConfig, *args: Any) -> Any:
        worker = make_worker(index, config, *args)
        if index == 0:
            controller, rollout = worker.controller, worker.rollout
            set_version = controller.set_version

            def set_version_and_release(version: int) -> None:
                set_version(version)
                if version >= release_at:
                    released.set()

            def held_rollout(group: int) -> list[dict[str, Any]]:
                if not released.is_set():
                    assert released.wait(timeout=scaled(300)), "the trainer never reached the release version"
                return rollout(group)

            controller.set_version = set_version_and_release
            worker.rollout = held_rollout
        return worker

    monkeypatch.setattr(grpo_lm, "_make_rollout_worker", make_with_a_straggler)
    config = _config(eta=eta, steps=release_at + 4, rollout_workers=3)
    result = train_grpo_lm(config)
    assert released.is_set()
    assert result.steps == config.steps
    assert result.max_staleness <= eta
    assert result.dropped_stale >= config.group_size  # at least the straggler's group


def test_decoupled_loss_anchors_the_clip_on_the_proximal_policy_and_caps_weights() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    proximal = torch.zeros(1, 3)
    behaviour = torch.tensor([[0.0, -3.0, -0.1]])  # weights 1, e^3 (over the cap), e^0.1
    advantages = torch.ones(1)

    def grad(cap: float | None) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = torch.zeros(1, 3, requires_grad=True)  # the trainer still at the proximal policy
        loss, stats = grpo_loss(logprobs, behaviour, advantages, mask, 0.2, proximal, behav_imp_weight_cap=cap)
        loss.backward()
        assert logprobs.grad is not None
        return logprobs.grad, stats

    capped, stats = grad(5.0)
    assert stats["losses/clipfrac"] == 0.0  # plain PPO would clip the stale tokens: ratio e^3 against behaviour
    assert stats["losses/behav_capped_frac"] == pytest.approx(1 / 3)
    assert capped[0, 1] == 0.0
    assert capped[0, 2] == pytest.approx(-math.exp(0.1) / 3)
    uncapped, _ = grad(None)
    assert uncapped[0, 1] == pytest.approx(-math.exp(3.0) / 3)
    _, plain = grpo_loss(torch.zeros(1, 3), behaviour, advantages, mask, 0.2)
    assert plain["losses/clipfrac"] > 0.0


def test_async_runner_feeds_recomputed_proximal_logprobs_to_the_loss(tmp_path: Path) -> None:
    """eta = 0: every sample comes from the trainer's current policy, so the proximal MFC's
    log-probs (recomputed by the trainer) must match the sampler's token by token."""
    config = _config(eta=0, steps=3, decoupled=True)
    result = train_grpo_lm(config, log_dir=tmp_path)
    rows = _progress(tmp_path)
    assert result.steps == 3 and len(rows) == 3
    for row in rows:
        assert row["timings/actor_prox_run_s"] > 0.0  # the MFC ran in every step
        assert row["losses/behav_imp_weight"] == pytest.approx(1.0, abs=1e-3)
        assert row["losses/behav_approx_kl"] < 1e-6


def _progress(log_dir: Path) -> list[dict[str, float]]:
    with (log_dir / "progress.csv").open(newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(handle)]


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path: Path) -> None:
    """Synchronous (eta = 0) runs are deterministic, so a run stopped after its step-2
    snapshot and resumed must end with the very weights of a run that was never stopped."""
    config = _config(model={"name": str(small_tiny_model())}, eta=0, steps=4, checkpoint_every=2, eval_every=2)
    straight = train_grpo_lm(config, log_dir=tmp_path / "straight")
    train_grpo_lm(config.model_copy(update={"steps": 2}), log_dir=tmp_path / "stopped")
    at_stop = read_snapshot(latest_snapshot(tmp_path / "stopped" / "snapshots"))
    resumed = train_grpo_lm(config, log_dir=tmp_path / "stopped", resume=True)
    final = read_snapshot(latest_snapshot(tmp_path / "straight" / "snapshots"))
    final_resumed = read_snapshot(latest_snapshot(tmp_path / "stopped" / "snapshots"))
    assert at_stop["version"] == 2 and final["version"] == final_resumed["version"] == 4
    assert any(not torch.equal(final["model"][k], at_stop["model"][k]) for k in final["model"])  # it learned
    for key, tensor in final["model"].items():
        assert torch.equal(final_resumed["model"][key], tensor), key
    assert [r for _, r, _ in resumed.curve] == [r for _, r, _ in straight.curve]
    assert [row["step"] for row in _progress(tmp_path / "stopped")] == [1, 2, 3, 4]


def test_async_resume_keeps_counters_stream_and_the_staleness_bound(tmp_path: Path) -> None:
    eta = 1
    config = _config(eta=eta, steps=3, checkpoint_every=3, rollout_workers=3)
    train_grpo_lm(config, log_dir=tmp_path)
    state = read_snapshot(latest_snapshot(tmp_path / "snapshots"))
    stream, controller = state["stream"], state["controller"]
    in_stream = collections.Counter(int(item["data"]["task_ids"]) for item in stream["items"])
    # One consistent cut: a group is wholly in the stream or in flight, never half or both.
    assert all(count == config.group_size for count in in_stream.values())
    assert not set(in_stream) & set(stream["pending_groups"])
    assert all(group < stream["next_group"] for group in [*in_stream, *stream["pending_groups"]])
    assert state["version"] == controller["version"] == 3
    waiting = 3 * config.batch_size + len(stream["items"]) + len(stream["pending_groups"]) * config.group_size
    assert waiting <= controller["started"] <= (3 + eta + 1) * config.batch_size

    resumed = train_grpo_lm(config.model_copy(update={"steps": 6}), log_dir=tmp_path, resume=True)
    assert resumed.steps == 6 and resumed.max_staleness <= eta
    assert read_snapshot(latest_snapshot(tmp_path / "snapshots"))["version"] == 6
    assert [row["step"] for row in _progress(tmp_path)] == [1, 2, 3, 4, 5, 6]
