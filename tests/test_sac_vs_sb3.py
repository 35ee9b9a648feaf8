"""rlplex's SAC update against Stable-Baselines3's, from the same weights, on the same batch,
with the same action noise.

Both start from SB3's initial actor and critics (copied into rlplex's layouts: one output
layer for mean and log std, the twin critics stacked), take the same minibatch and draw the
same Gaussian noise (rlplex's generator is given the global generator's state that SB3's
sampling uses). Any difference in the squashed log-probability, the target, the critic, actor
or temperature losses, their order, alpha's value, Adam or the polyak step shows up in the
losses and parameters. The one known difference: SB3 computes log(1 - tanh(u)^2 + 1e-6),
rlplex log(1 - tanh(u)^2) exactly, so the comparison has a small tolerance.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlplex.algos.sac as sac_module
from rlplex.agents import SacAgent
from rlplex.algos.sac import SAC, SACConfig
from rlplex.envs import EnvSpaces

sb3 = pytest.importorskip("stable_baselines3")

OBS, ACT, BATCH, STEPS = 5, 2, 64, 3


class _Spec(gym.Env[np.ndarray, np.ndarray]):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (ACT,), np.float32)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "observation": torch.randn(BATCH, OBS, generator=g),
        "action": torch.rand(BATCH, ACT, generator=g) * 2 - 1,
        "reward": torch.randn(BATCH, generator=g),
        "next_observation": torch.randn(BATCH, OBS, generator=g),
        "terminated": torch.rand(BATCH, generator=g) < 0.2,
    }


def _copy_sb3_weights(model: Any, algo: SAC) -> None:
    actor, net = model.actor, algo.agent.actor.net  # type: ignore[union-attr]
    with torch.no_grad():
        for i in (0, 2):
            net[i].weight.copy_(actor.latent_pi[i].weight)
            net[i].bias.copy_(actor.latent_pi[i].bias)
        net[4].weight.copy_(torch.cat((actor.mu.weight, actor.log_std.weight)))
        net[4].bias.copy_(torch.cat((actor.mu.bias, actor.log_std.bias)))
        for ours, theirs in ((algo.critic, model.critic), (algo.critic_target, model.critic_target)):
            for k, q in enumerate(theirs.q_networks):
                for layer, i in enumerate((0, 2, 4)):
                    ours.weights[layer][k].copy_(q[i].weight.T)
                    ours.biases[layer][k, 0].copy_(q[i].bias)


def _rlplex_critic_of_sb3(model: Any, algo: SAC) -> list[torch.Tensor]:
    """SB3's critic parameters in rlplex's stacked layout."""
    out = []
    for layer, i in enumerate((0, 2, 4)):
        out.append(torch.stack([q[i].weight.T for q in model.critic.q_networks]))
        out.append(torch.stack([q[i].bias[None] for q in model.critic.q_networks]))
        assert out[-2].shape == algo.critic.weights[layer].shape
    return out


def test_sac_updates_equal_sb3s(monkeypatch: pytest.MonkeyPatch) -> None:
    from stable_baselines3.common.logger import configure
    from stable_baselines3.common.type_aliases import ReplayBufferSamples

    torch.manual_seed(0)
    model = sb3.SAC("MlpPolicy", _Spec(), batch_size=BATCH, learning_starts=0, device="cpu", seed=0)
    model.set_logger(configure(None, []))
    spaces = EnvSpaces((OBS,), "continuous", 0, (ACT,), (-1.0,) * ACT, (1.0,) * ACT)
    algo = SAC(SACConfig(batch_size=BATCH, learning_starts=0, buffer_size=BATCH), seed=0)
    algo.initialize(SacAgent(spaces, hidden=(256, 256)), n_itr=1)
    _copy_sb3_weights(model, algo)
    batch = _batch()
    b = {k: v.float() for k, v in batch.items()}
    samples = ReplayBufferSamples(
        b["observation"], b["action"], b["next_observation"], b["terminated"][:, None], b["reward"][:, None]
    )
    model.replay_buffer.sample = lambda *args, **kwargs: samples  # type: ignore[method-assign]
    monkeypatch.setattr(sac_module, "sample_tensors", lambda *args: batch)
    assert algo.replay is not None
    algo.replay.append_samples({k: v.numpy() for k, v in batch.items()} | {"done": batch["terminated"].numpy()})

    for step in range(STEPS):
        noise_state = torch.get_rng_state()
        model.train(gradient_steps=1, batch_size=BATCH)
        theirs = dict(model.logger.name_to_value)
        algo._generator.set_state(noise_state)  # the noise SB3's sampling drew
        ours = algo.optimize_agent(step, None)
        for our_key, their_key in (
            ("losses/critic", "train/critic_loss"),
            ("losses/actor", "train/actor_loss"),
            ("losses/alpha", "train/ent_coef_loss"),
            ("charts/alpha", "train/ent_coef"),
        ):
            assert ours[our_key] == pytest.approx(theirs[their_key], rel=1e-4, abs=1e-5), (step, our_key)

    # Parameters after STEPS Adam steps: equal up to the log-prob epsilon (Adam's first steps
    # are about lr * sign(gradient), so an almost-zero gradient may step either way).
    lr = SACConfig().learning_rate
    assert algo.log_alpha.item() == pytest.approx(model.log_ent_coef.item(), abs=1e-6)
    ours_critic = [p for pair in zip(algo.critic.weights, algo.critic.biases, strict=True) for p in pair]
    pairs = list(zip(_rlplex_critic_of_sb3(model, algo), ours_critic, strict=True))
    actor, net = model.actor, algo.agent.actor.net  # type: ignore[union-attr]
    sb3_actor = [
        actor.latent_pi[0].weight,
        actor.latent_pi[2].weight,
        torch.cat((actor.mu.weight, actor.log_std.weight)),
    ]
    pairs += list(zip(sb3_actor, [net[0].weight, net[2].weight, net[4].weight], strict=True))
    for theirs_p, ours_p in pairs:
        diff = (theirs_p.detach() - ours_p.detach()).abs()
        assert diff.max().item() <= 2 * STEPS * lr, diff.max().item()
        assert (diff > 1e-6).float().mean().item() < 0.01
    # The targets moved by polyak averaging from the same start to (almost) the same critics.
    sb3_target = [q[2].weight.T for q in model.critic_target.q_networks]
    torch.testing.assert_close(algo.critic_target.weights[1], torch.stack(sb3_target), atol=1e-5, rtol=0)
