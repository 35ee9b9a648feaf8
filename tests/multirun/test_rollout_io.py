"""The rollout files between orchestrator and trainer: a round trip, and every malformed case refused."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.rollouts import (
    ROLLOUT_FILE,
    MalformedRolloutError,
    RolloutBatch,
    read_rollouts,
    rollouts_ready,
    write_rollouts,
)


def make_batch(n: int = 3, length: int = 6) -> RolloutBatch:
    attention = torch.ones(n, length, dtype=torch.int64)
    attention[0, 0] = 0  # a left-padded prompt
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, 3:] = True
    return RolloutBatch(
        run_id="run_a",
        step=2,
        policy_step=1,
        tokens=torch.randint(1, 20, (n, length)),
        attention=attention,
        loss_mask=mask,
        logprobs=torch.where(mask, -torch.rand(n, length), torch.zeros(n, length)),
        advantages=torch.randn(n),
        rewards=torch.rand(n),
    )


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    (tmp_path / "run_a").mkdir()
    return RunDir(tmp_path, "run_a")


def test_round_trip_keeps_every_tensor(run: RunDir) -> None:
    batch = make_batch()
    assert not rollouts_ready(run, 2)
    write_rollouts(run, batch)
    assert rollouts_ready(run, 2)
    loaded = read_rollouts(run, 2, vocab_size=20)
    assert (loaded.run_id, loaded.step, loaded.policy_step, loaded.n) == ("run_a", 2, 1, 3)
    for name, tensor in batch.tensors().items():
        assert torch.equal(getattr(loaded, name), tensor), name
    assert loaded.n_tokens == 9


def _set(name: str, value: Callable[[RolloutBatch], torch.Tensor]) -> Callable[[RolloutBatch], None]:
    return lambda batch: setattr(batch, name, value(batch))


BREAKAGES: dict[str, tuple[Callable[[RolloutBatch], None], str]] = {
    "nan reward": (_set("rewards", lambda b: torch.tensor([0.0, float("nan"), 1.0])), "rewards holds NaN"),
    "wrong dtype": (_set("tokens", lambda b: b.tokens.float()), "tokens must be torch.int64"),
    "wrong shape": (_set("advantages", lambda b: torch.zeros(5)), "advantages has shape [5]"),
    "empty": (_set("tokens", lambda b: torch.zeros(0, 6, dtype=torch.int64)), "tokens must be [n >= 1"),
    "no loss tokens": (_set("loss_mask", lambda b: torch.zeros_like(b.loss_mask)), "selects no token"),
    "mask on padding": (_set("loss_mask", lambda b: torch.ones_like(b.loss_mask)), "selects padding"),
    "positive logprob": (_set("logprobs", lambda b: b.logprobs + b.loss_mask.float()), "logprobs must be <= 0"),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_a_malformed_batch_is_refused_with_its_reason(run: RunDir, case: str) -> None:
    batch = make_batch()
    write_rollouts(run, batch)
    broken = make_batch()
    BREAKAGES[case][0](broken)
    # Written behind the writer's back, as a faulty orchestrator would.
    save_file(broken.tensors(), str(run.rollout_step(2) / ROLLOUT_FILE))
    with pytest.raises(MalformedRolloutError, match=re.escape(BREAKAGES[case][1])):
        read_rollouts(run, 2)
    with pytest.raises(MalformedRolloutError, match=re.escape(BREAKAGES[case][1])):
        write_rollouts(run, broken)


def test_truncated_file_unknown_token_and_lying_meta_are_refused(run: RunDir) -> None:
    write_rollouts(run, make_batch())
    path = run.rollout_step(2) / ROLLOUT_FILE
    data = path.read_bytes()
    with pytest.raises(MalformedRolloutError, match="outside the vocabulary of 10"):
        read_rollouts(run, 2, vocab_size=10)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MalformedRolloutError, match="unreadable rollouts"):
        read_rollouts(run, 2)
    path.write_bytes(data)
    meta = run.rollout_step(2) / "meta.json"
    meta.write_text(json.dumps({"run_id": "run_a", "step": 2, "policy_step": 1, "n": 4}))
    with pytest.raises(MalformedRolloutError, match="n=4"):
        read_rollouts(run, 2)
    meta.write_text(json.dumps({"run_id": "run_b", "step": 2, "policy_step": 1, "n": 3}))
    with pytest.raises(MalformedRolloutError, match="written for run 'run_b'"):
        read_rollouts(run, 2)
    meta.write_text("[1, 2]")
    with pytest.raises(MalformedRolloutError, match="expected a JSON object"):
        read_rollouts(run, 2)
