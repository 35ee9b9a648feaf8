"""R2D1: the value rescaling, sequences cut from sampler batches, burn-in without gradient,
prioritized sequence replay, exact resume, and runs under MinibatchRl and AsyncRl."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlplex.agents.recurrent import R2d1Agent
from rlplex.algos import R2D1, R2D1Config  # exported beside the other algorithms
from rlplex.algos.r2d1 import sequence_loss
from rlplex.algos.rl_math import inverse_value_rescale, value_rescale
from rlplex.config import validate_config
from rlplex.envs import CARTPOLE_NO_VELOCITY, EnvConfig, probe_spaces
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.replays.sequence import SequenceCarry, sequences_of
from rlplex.runners.config import TrainConfig, build_runner
from rlplex.samplers import SerialSampler
from rlplex.samplers.batch import SampleBatch

NO_VEL = EnvConfig(id=CARTPOLE_NO_VELOCITY)
SMALL = dict(burn_in=4, learn_length=6, n_step=2, batch_size=8, learning_starts=8, buffer_size=64, updates_per_itr=2)


def make_r2d1(seed: int, **config: object) -> R2D1:
    torch.manual_seed(seed)
    algo = R2D1(R2D1Config.model_validate({**SMALL, **config}), seed=seed)
    algo.initialize(R2d1Agent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8), n_itr=10)
    return algo


def batches(agent: R2d1Agent, n: int, T: int = 24, B: int = 4) -> list[SampleBatch]:
    sampler = SerialSampler(NO_VEL, batch_T=T, batch_B=B)
    sampler.initialize(agent, seed=0)
    try:
        return [sampler.obtain_samples(i).copy() for i in range(n)]
    finally:
        sampler.shutdown()


def test_value_rescaling_and_its_inverse_round_trip() -> None:
    x = torch.cat([torch.linspace(-1e4, 1e4, 20001, dtype=torch.float64), torch.tensor([0.0, 1e-6, -3.5])])
    torch.testing.assert_close(inverse_value_rescale(value_rescale(x)), x, rtol=1e-9, atol=1e-8)
    torch.testing.assert_close(value_rescale(inverse_value_rescale(x)), x, rtol=1e-9, atol=1e-8)
    assert float(value_rescale(torch.tensor(3.0), eps=0.0)) == pytest.approx(1.0)  # sqrt(4) - 1
    assert float(value_rescale(torch.tensor(-8.0), eps=0.1)) == pytest.approx(-2.0 - 0.8)


def test_sequences_keep_time_order_overlap_and_their_start_state() -> None:
    agent = R2d1Agent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8)
    agent.set_epsilon(0.5)
    batch = batches(agent, 2)[1]  # a batch that starts mid-episode
    seqs = sequences_of(batch, length=12, period=6)  # starts 0, 6, 12 over T = 24
    assert seqs["observation"].shape == (3 * 4, 12, 2) and seqs["rnn_h"].shape == (12, 8)
    for s, start in enumerate((0, 6, 12)):
        for b in range(4):
            i = s * 4 + b
            np.testing.assert_array_equal(seqs["observation"][i], batch.observation[start : start + 12, b])
            np.testing.assert_array_equal(seqs["action"][i], batch.action[start : start + 12, b])
            np.testing.assert_array_equal(seqs["rnn_h"][i], batch.agent_info["rnn_h"][start, b])
    assert np.abs(seqs["rnn_h"]).sum() > 0
    # Consecutive sequences of one environment overlap by length - period steps.
    np.testing.assert_array_equal(seqs["observation"][0][6:], seqs["observation"][4][:6])


def joined(first: SampleBatch, second: SampleBatch) -> SimpleNamespace:
    """Two consecutive batches as one of 2T steps: each environment's stream unbroken."""
    both = {
        name: np.concatenate([getattr(first, name), getattr(second, name)])
        for name in ("observation", "action", "reward", "terminated", "truncated")
    }
    info = {k: np.concatenate([first.agent_info[k], second.agent_info[k]]) for k in ("rnn_h", "rnn_c")}
    return SimpleNamespace(T=first.T + second.T, agent_info=info, **both)


@pytest.mark.parametrize(("T", "length", "period"), [(24, 12, 5), (8, 12, 5), (24, 35, 20)])
def test_carried_sequences_run_on_across_batches_as_in_one_long_batch(T: int, length: int, period: int) -> None:
    """Batches cut one after the other with the carry give the sequences of the joined stream:
    a start every `period` steps, wherever batch boundaries fall, even in batches shorter than
    one sequence."""
    agent = R2d1Agent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8)
    agent.set_epsilon(0.5)
    data = batches(agent, 6, T=T)
    carry, cut = SequenceCarry(length, period), []
    for batch in data:
        cut.append(carry.cut(batch))
    stream = data[0]
    for batch in data[1:]:
        stream = joined(stream, batch)  # type: ignore[arg-type]
    whole = sequences_of(stream, length, period)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([c[name] for c in cut]), value, err_msg=name)
    assert len(whole["reward"]) == 4 * ((6 * T - length) // period + 1)

    # What is kept is what the next sequences start in; a reloaded carry cuts the same ones.
    resumed = SequenceCarry(length, period)
    resumed.load_state_dict({k: v.copy() for k, v in carry.state_dict().items()})
    extra = batches(agent, 1, T=T)[0]
    after, after_resume = carry.cut(extra), resumed.cut(extra)
    for name, value in after.items():
        np.testing.assert_array_equal(after_resume[name], value, err_msg=name)


def test_a_carry_cut_by_a_restart_resets_the_state_where_the_old_steps_end() -> None:
    """A resumed run starts new episodes: the kept steps' last one becomes done, so a sequence
    across the restart resets the recurrent state there and cuts its returns."""
    agent = R2d1Agent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8)
    carry = SequenceCarry(12, 5)
    carry.cut(batches(agent, 1, T=24)[0])
    resumed = SequenceCarry(12, 5)
    resumed.load_state_dict(carry.state_dict())
    restarted = batches(agent, 1, T=24)[0]  # a fresh sampler: every environment reset
    restarted.observation[0] += 1.0  # (and not where the kept steps left off)
    kept = carry.state_dict()
    assert not kept["done"][-1].all()
    cut = resumed.cut(restarted)
    # Starts 0, 5, 10 fitted in the first 24 steps; steps 15..23 were kept, so the first
    # sequences after the restart (one per environment) hold them at positions 0..8.
    assert cut["done"][: restarted.B, 8].all()
    assert np.array_equal(cut["done"][: restarted.B, :8], kept["done"][:8].T)


def test_a_shared_carry_cut_in_turn_through_two_attachments_equals_one_carry() -> None:
    """AsyncRl's two copiers cut alternate batches through one carry in shared memory: the
    sequences, and what the learner snapshots, are those of a carry that saw every batch."""
    agent = R2d1Agent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8)
    agent.set_epsilon(0.5)
    data = batches(agent, 6, T=8)  # shorter than a sequence: starts fall in every other batch
    local = SequenceCarry(12, 5)
    shared = SequenceCarry.create_shared(12, 5, agent.spaces, 4, agent.state_size)
    try:
        copiers = [SequenceCarry.attach(shared.handle) for _ in range(2)]
        for i, batch in enumerate(data):
            want, got = local.cut(batch), copiers[i % 2].cut(batch)
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value, err_msg=f"batch {i}: {name}")
        for name, value in local.state_dict().items():
            np.testing.assert_array_equal(shared.state_dict()[name], value, err_msg=name)
        # A snapshot of another number of environments does not fit: the carry starts afresh.
        shared.load_state_dict({k: v[:, :2] if v.ndim > 1 and k != "next_observation" else v[:2]
                                for k, v in local.state_dict().items()})  # fmt: skip
        assert shared.state_dict() == {}
        for copier in copiers:
            copier.close()
    finally:
        shared.close()


def test_burn_in_steps_get_no_gradient_and_the_learned_steps_do() -> None:
    algo = make_r2d1(0)
    assert algo.agent is not None and algo.target is not None
    for itr, batch in enumerate(batches(algo.agent, 2)):
        algo.replay.append_samples(algo.sampler_to_buffer(batch))
        del itr
    minibatch, _, _ = algo.minibatch()
    obs = minibatch["observation"].clone().requires_grad_(True)
    loss, abs_delta, _ = sequence_loss(algo.agent.model, algo.target, {**minibatch, "observation": obs}, algo.config)
    loss.backward()
    assert obs.grad is not None
    burn = algo.config.burn_in
    assert torch.all(obs.grad[:burn] == 0)
    assert obs.grad[burn:].abs().sum() > 0
    assert abs_delta.shape == (algo.config.learn_length, algo.config.batch_size)


def test_priorities_follow_the_max_mean_mix_of_td_errors() -> None:
    algo = make_r2d1(0)
    assert algo.agent is not None
    algo.replay.append_samples(algo.sampler_to_buffer(batches(algo.agent, 1)[0]))
    algo._update()
    tree = algo.replay.tree
    leaves = tree.leaves(np.arange(algo.replay.size))
    assert np.all(leaves > 0) and len(np.unique(leaves)) > 1  # sampled sequences moved off the max priority


def test_resume_from_a_snapshot_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = make_r2d1(0)
    assert uninterrupted.agent is not None
    data = batches(uninterrupted.agent, 4)
    for itr in (0, 1):
        uninterrupted.optimize_agent(itr, data[itr])
    write_snapshot(
        tmp_path / "s", {"algo": uninterrupted.state_dict(), "agent": uninterrupted.agent.model.state_dict()}
    )
    state = read_snapshot(tmp_path / "s")
    resumed = make_r2d1(1)  # other weights, replay and generator until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (2, 3):
        assert uninterrupted.optimize_agent(itr, data[itr]) == resumed.optimize_agent(itr, data[itr])
    for key, value in uninterrupted.agent.model.state_dict().items():
        assert torch.equal(value, resumed.agent.model.state_dict()[key]), key
    assert resumed.update_count == uninterrupted.update_count == 8  # 2 a batch from the first
    np.testing.assert_array_equal(uninterrupted.replay.tree.tree, resumed.replay.tree.tree)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["minibatch", "async"])
def test_r2d1_trains_under_minibatch_and_async_runners(kind: str, tmp_path: Path) -> None:
    config = validate_config(
        TrainConfig,
        {
            "env": {"id": CARTPOLE_NO_VELOCITY},
            "sampler": {"batch_T": 24, "batch_B": 2},
            "agent": {"hidden": [16], "lstm_size": 8},
            "algo": {"name": "r2d1", **SMALL},
            "runner": {"kind": kind, "n_steps": 960, "log_interval_steps": 480, "replay_ratio": 1.0},
        },
        "test.toml",
    )
    runner = build_runner(config, tmp_path / kind, show_progress=False)
    result = runner.train()
    assert result.env_steps >= 960
    assert any("losses/td" in row for row in result.history), result.history
    snapshot = read_snapshot(sorted((tmp_path / kind / "snapshots").iterdir())[-1])
    assert snapshot["algo"]["update_count"] > 0 and snapshot["algo"]["replay"]["counters"][1] > 0


def test_under_async_sequences_run_on_across_batches_shorter_than_one() -> None:
    """Batches of 8 steps, sequences of 12 (a start every 6): the copiers cut through the shared
    carry in turn, so the replay gets every sequence of each environment's whole stream."""
    config = validate_config(
        TrainConfig,
        {
            "env": {"id": CARTPOLE_NO_VELOCITY},
            "sampler": {"batch_T": 8, "batch_B": 2},
            "agent": {"hidden": [16], "lstm_size": 8},
            "algo": {"name": "r2d1", **SMALL},
            "runner": {"kind": "async", "n_steps": 480, "log_interval_steps": 480, "replay_ratio": 1.0},
        },
        "test.toml",
    )
    runner = build_runner(config, None, show_progress=False)
    appended: list[int] = []
    close = runner.algo.shutdown

    def count_then_close() -> None:  # the replay's count, read before the runner frees it
        appended.append(runner.algo.replay.total_appended)
        close()

    runner.algo.shutdown = count_then_close
    result = runner.train()
    assert result.env_steps == 480  # every batch copied: 240 steps of each environment
    length, period = 12, 6  # burn_in + learn_length + n_step, learn_length
    assert appended == [2 * ((240 - length) // period + 1)]
