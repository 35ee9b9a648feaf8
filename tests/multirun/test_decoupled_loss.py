"""A run's `loss.decoupled`: the shared trainer trains it with AReaL's decoupled PPO objective
(proximal policy = the adapter before the step; behaviour re-weighting, capped), row by row
beside runs that train with plain PPO in the same micro-batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from mr_train_helpers import (
    PACKED,
    assert_same_weights,
    broadcast_weights,
    make_trainer,
    new_train_run,
    synthetic_batch,
    train_until,
)

from rlplex.algos.rl_math import clipped_surrogate
from rlplex.errors import RunConfigError
from rlplex.multirun.orchestrator.config import orch_config_to_toml, parse_orch_config, read_orch_config
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.rollouts import write_rollouts

DECOUPLED = {"loss": {"decoupled": True, "behav_imp_weight_cap": 5.0}}


def _write(output_dir: Path, run_id: str, behaviour_shift: float) -> None:
    """Step 0's rollouts with the base policy's own log-probs (the trainer's policy at step 0:
    LoRA B starts at zero), shifted by `behaviour_shift` (negative: the behaviour policy found
    every token less likely than the trainer does)."""
    from mr_train_helpers import base_model

    from rlplex.models.device import model_device
    from rlplex.models.lm import token_logprobs

    batch = synthetic_batch(run_id, 0, n=8)
    device = model_device(base_model())
    with torch.no_grad():
        base = token_logprobs(base_model(), batch.tokens.to(device), batch.attention.to(device)).cpu().float()
    logprobs = torch.where(batch.loss_mask, base + behaviour_shift, 0.0)
    write_rollouts(RunDir(output_dir, run_id), dataclasses.replace(batch, logprobs=logprobs))


def _train_one_step(output_dir: Path, runs: dict[str, tuple[dict[str, object], float]]) -> dict[str, dict]:
    for run_id, (overrides, shift) in runs.items():
        new_train_run(output_dir, run_id, optim={"lr": 0.01}, **overrides)
        _write(output_dir, run_id, shift)
    trainer = make_trainer(output_dir, len(runs), **PACKED)
    train_until(trainer, dict.fromkeys(runs, 1))
    return {run_id: broadcast_weights(output_dir, run_id, 1) for run_id in runs}


def test_on_policy_rollouts_train_the_same_decoupled_or_plain(tmp_path: Path) -> None:
    # Behaviour = proximal: every weight is 1 and the ratio is 1 in both objectives.
    plain = _train_one_step(tmp_path / "plain", {"run_o": ({}, 0.0)})["run_o"]
    decoupled = _train_one_step(tmp_path / "decoupled", {"run_o": (DECOUPLED, 0.0)})["run_o"]
    before = broadcast_weights(tmp_path / "plain", "run_o", 0)
    assert any(not torch.equal(before[k], plain[k]) for k in before), "the run did not train"
    assert_same_weights(decoupled, plain)


def test_tokens_past_the_cap_give_a_decoupled_run_no_gradient_while_a_plain_run_beside_it_trains(
    tmp_path: Path,
) -> None:
    # Behaviour 3 nats below the trainer's policy on every token: proximal/behaviour = e^3 > 5,
    # so every token of the decoupled run is capped; the plain run's ratio e^3 is clipped only
    # where the advantage is positive, and it trains on the others.
    after = _train_one_step(
        tmp_path, {"run_d": (DECOUPLED, -3.0), "run_p": ({}, -3.0), "run_u": ({"loss": {"decoupled": True}}, -1.0)}
    )
    before = {run_id: broadcast_weights(tmp_path, run_id, 0) for run_id in after}
    assert all(torch.equal(before["run_d"][k], after["run_d"][k]) for k in before["run_d"]), "capped run moved"
    assert any(not torch.equal(before["run_p"][k], after["run_p"][k]) for k in before["run_p"])
    # e^1 < 5: under the cap, the decoupled run trains (re-weighted, not clipped).
    assert any(not torch.equal(before["run_u"][k], after["run_u"][k]) for k in before["run_u"])


def test_the_decoupled_gradient_is_the_capped_behaviour_weight_times_the_policy_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -0.5, -3.0]])  # weights e^0.5, e^-1.5, e^2.5 (> cap 5: zero)
    advantage = torch.tensor([2.0])
    mask = torch.tensor([[True, True, True]])
    surrogate = clipped_surrogate(
        logp,
        behaviour,
        advantage,
        0.2,
        mask=mask,
        proximal_logp=logp.detach(),
        behav_imp_weight_cap=torch.tensor([[5.0]]),
    )
    surrogate.loss.sum().backward()
    weight = (logp.detach() - behaviour).exp()
    weight = torch.where(weight > 5.0, 0.0, weight)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -advantage * weight)
    assert float(weight[0, 2]) == 0.0


def test_a_run_loss_config_round_trips_through_orch_toml_and_names_a_bad_cap(tmp_path: Path) -> None:
    run = new_train_run(tmp_path, "run_x", loss={"decoupled": True, "behav_imp_weight_cap": 3.5})
    config = read_orch_config(run.orch_config, within=run.root)
    assert config.loss.decoupled and config.loss.behav_imp_weight_cap == 3.5
    assert "[loss]" in orch_config_to_toml(config)
    data = config.model_dump()
    data["loss"]["behav_imp_weight_cap"] = 0.5
    with pytest.raises(RunConfigError, match=r"loss\.behav_imp_weight_cap"):
        parse_orch_config(data, "orch.toml")
