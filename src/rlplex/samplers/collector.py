"""The environment-stepping loop shared by every sampler.

`EnvCollector` steps a group of environments in lockstep, one batched policy call per time
step (a policy call costs far more than a CartPole step, so it is amortised over the
group), and writes each step into a [T, B] `SampleBatch` view. Episodes carry over from one
batch to the next; an environment that ends is reset at once and its final observation is
kept in `next_observation`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from rlplex.envs import EnvSpaces

Policy = Callable[[np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]]


class EnvCollector:
    def __init__(self, envs: Sequence[gym.Env[Any, Any]], spaces: EnvSpaces, seeds: Sequence[int]) -> None:
        self.envs = list(envs)
        self.spaces = spaces
        self._seeds = list(seeds)
        self._clip = spaces.action_kind == "continuous"
        if self._clip:
            self._low = np.asarray(spaces.action_low, dtype=np.float32).reshape(spaces.action_shape)
            self._high = np.asarray(spaces.action_high, dtype=np.float32).reshape(spaces.action_shape)
        n = len(self.envs)
        self.observation = np.zeros((n, *spaces.obs_shape), dtype=spaces.obs_dtype)
        self._episode_return = np.zeros(n, dtype=np.float64)
        self._episode_length = np.zeros(n, dtype=np.int64)
        self._started = False

    def reset(self) -> None:
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=self._seeds[i])
            self.observation[i] = obs
        self._episode_return[:] = 0
        self._episode_length[:] = 0
        self._started = True

    def collect(self, policy: Policy, out: Any) -> None:
        """Fill every time step of `out` (a SampleBatch whose B equals the number of envs)."""
        if not self._started:
            self.reset()
        out.completed_return.fill(np.nan)
        out.completed_length.fill(0)
        for t in range(out.T):
            out.observation[t] = self.observation
            action, info = policy(self.observation)
            out.action[t] = action
            for key, value in info.items():
                out.agent_info[key][t] = value
            env_action = np.clip(action, self._low, self._high) if self._clip else action
            self._step_envs(env_action, out, t)

    def _step_envs(self, env_action: np.ndarray, out: Any, t: int) -> None:
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, _ = env.step(env_action[i])
            out.reward[t, i] = reward
            out.terminated[t, i] = terminated
            out.truncated[t, i] = truncated
            out.next_observation[t, i] = obs
            self._episode_return[i] += reward
            self._episode_length[i] += 1
            if terminated or truncated:
                out.completed_return[t, i] = self._episode_return[i]
                out.completed_length[t, i] = self._episode_length[i]
                self._episode_return[i] = 0.0
                self._episode_length[i] = 0
                obs, _ = env.reset()
            self.observation[i] = obs

    def close(self) -> None:
        for env in self.envs:
            env.close()


def run_episodes(
    envs: Sequence[gym.Env[Any, Any]], spaces: EnvSpaces, act: Callable[[np.ndarray], np.ndarray], seeds: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Run one episode in each env, in lockstep; returns (returns, lengths)."""
    n = len(envs)
    obs = np.zeros((n, *spaces.obs_shape), dtype=spaces.obs_dtype)
    for i, env in enumerate(envs):
        obs[i], _ = env.reset(seed=seeds[i])
    returns = np.zeros(n, dtype=np.float64)
    lengths = np.zeros(n, dtype=np.int64)
    running = np.ones(n, dtype=bool)
    clip = spaces.action_kind == "continuous"
    while running.any():
        action = act(obs)
        if clip:
            action = np.clip(action, spaces.action_low, spaces.action_high)
        for i in np.flatnonzero(running).tolist():
            o, r, term, trunc, _ = envs[i].step(action[i])
            obs[i] = o
            returns[i] += r
            lengths[i] += 1
            if term or trunc:
                running[i] = False
    return returns, lengths
