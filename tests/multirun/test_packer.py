"""The packer: fair by loss tokens, a step completes only when all its rows are packed, wire format."""

from __future__ import annotations

import pytest
import torch

from rlplex.multirun.rundir.rollouts import RolloutBatch
from rlplex.multirun.trainer.packer import MicroBatch, Packer, Piece


def batch(run_id: str, n: int, loss_tokens: int, width: int | None = None, step: int = 0) -> RolloutBatch:
    width = width or loss_tokens + 2
    mask = torch.zeros(n, width, dtype=torch.bool)
    mask[:, width - loss_tokens :] = True
    return RolloutBatch(
        run_id=run_id,
        step=step,
        policy_step=step,
        tokens=torch.arange(n * width).view(n, width) % 30 + 3,
        attention=torch.ones(n, width, dtype=torch.int64),
        loss_mask=mask,
        logprobs=-torch.rand(n, width) * mask,
        advantages=torch.randn(n),
        rewards=torch.rand(n),
    )


def packed_tokens(packer: Packer, plan_micro: list[list[Piece]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for micro in plan_micro:
        for piece in micro:
            out[piece.idx] = out.get(piece.idx, 0) + sum(
                packer.pending[piece.idx].row_loss_tokens[piece.start : piece.stop]
            )
    return out


def test_fair_by_tokens_not_by_turns() -> None:
    # Run 0 has long samples (100 loss tokens), run 1 short ones (10): turn by turn would give
    # run 0 ten times the tokens of run 1; fair by tokens gives both about the same.
    packer = Packer(micro_tokens=1000, micro_batches=2)
    packer.add(0, batch("run_long", 30, 100))
    packer.add(1, batch("run_short", 300, 10))
    plan = packer.plan()
    tokens = packed_tokens(packer, plan.micro_batches)
    assert tokens[0] > 0 and tokens[1] > 0
    assert abs(tokens[0] - tokens[1]) <= 100, tokens  # within one long sample
    rows = {idx: sum(p.stop - p.start for m in plan.micro_batches for p in m if p.idx == idx) for idx in (0, 1)}
    assert rows[1] >= 5 * rows[0], rows
    assert plan.completes == []


def test_a_step_advances_only_when_all_its_rows_are_packed() -> None:
    packer = Packer(micro_tokens=24, micro_batches=1)  # two 12-wide rows per iteration
    packer.add(0, batch("run_a", 5, 10))
    plans = []
    while packer.has_work():
        plans.append(packer.plan())
        for idx in plans[-1].completes:
            packer.finish(idx)
    assert [p.completes for p in plans] == [[], [], [0]]
    assert [sum(pc.stop - pc.start for pc in p.micro_batches[0]) for p in plans] == [2, 2, 1]
    assert not packer.pending


def test_only_runs_with_complete_steps_step() -> None:
    packer = Packer(micro_tokens=60, micro_batches=1)
    packer.add(0, batch("run_a", 2, 10, width=12))
    packer.add(1, batch("run_b", 10, 10, width=12))
    plan = packer.plan()
    assert plan.completes == [0]  # run_a's two rows fit; run_b still has rows left
    with pytest.raises(ValueError, match="still has"):
        packer.finish(1)


def test_a_newcomer_does_not_claim_a_backlog() -> None:
    packer = Packer(micro_tokens=1200, micro_batches=1)
    packer.add(0, batch("run_a", 200, 10))
    packer.plan()  # run_a served ~1000 tokens alone
    packer.add(1, batch("run_b", 200, 10))
    tokens = packed_tokens(packer, packer.plan().micro_batches)
    assert abs(tokens[0] - tokens[1]) <= 10, tokens


def test_dropped_run_is_forgotten() -> None:
    packer = Packer(micro_tokens=30, micro_batches=1)
    packer.add(0, batch("run_a", 10, 10))
    packer.plan()
    packer.drop(0)
    assert not packer.has_work() and 0 not in packer.served
    packer.add(0, batch("run_new", 1, 10))  # the slot can hold a new run
    assert packer.plan().completes == [0]


def test_micro_batch_mixes_runs_with_per_run_token_weights_and_survives_the_wire() -> None:
    packer = Packer(micro_tokens=10_000, micro_batches=1)
    a, b = batch("run_a", 3, 4, width=6), batch("run_b", 2, 7, width=9)
    packer.add(2, a)
    packer.add(0, b)
    plan = packer.plan()
    assert len(plan.micro_batches) == 1 and plan.completes == [0, 2]
    micro = packer.materialize(plan.micro_batches[0])
    assert micro.tokens.shape == (5, 9)
    assert sorted(micro.adapter_ids.tolist()) == [0, 0, 2, 2, 2]
    weights = dict(zip(micro.adapter_ids.tolist(), micro.token_weight.tolist(), strict=True))
    assert weights[2] == pytest.approx(1 / 12) and weights[0] == pytest.approx(1 / 14)
    padded = micro.adapter_ids == 2
    assert not micro.loss_mask[padded, 6:].any() and not micro.attention[padded, 6:].any()
    ints, floats = micro.to_wire()
    assert (ints.numel(), floats.numel()) == MicroBatch.wire_sizes(5, 9)
    back = MicroBatch.from_wire(ints, floats, 5, 9)
    for name in ("tokens", "attention", "loss_mask", "logprobs", "advantages", "token_weight", "adapter_ids"):
        assert torch.equal(getattr(back, name), getattr(micro, name)), name
