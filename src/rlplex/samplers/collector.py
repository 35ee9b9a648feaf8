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
from rlplex.samplers.rng import env_rng_state, set_env_rng_state

Policy = Callable[[np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]]
StateReset = Callable[[np.ndarray], None]  # a recurrent agent's `reset_state(done_B)`
StepResults = tuple[list[Any], list[Any], list[Any], list[int]]  # rewards, terminated, truncated, ended


class EnvCollector:
    def __init__(self, envs: Sequence[gym.Env[Any, Any]], spaces: EnvSpaces, seeds: Sequence[int]) -> None:
        self.envs = list(envs)
        self.spaces = spaces
        self._seeds: list[int | None] = list(seeds)
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

    def rng_states(self) -> list[Any]:
        """Each environment's generator state (JSON values; None before its first reset)."""
        return [env_rng_state(env) for env in self.envs]

    def restore_rng_states(self, states: Sequence[Any]) -> None:
        """Continue each environment's generator from `states`: the next batch starts new
        episodes, reset without a seed so that they draw from the restored generator. An int
        is a new seed instead (`rlplex.samplers.rng.fit_env_states`); None keeps the seed."""
        for i, (env, state) in enumerate(zip(self.envs, states, strict=True)):
            if isinstance(state, int):
                self._seeds[i] = state
            elif state is not None:
                set_env_rng_state(env, state)
                self._seeds[i] = None
        self._started = False

    def collect(self, policy: Policy, out: Any, reset_state: StateReset | None = None) -> None:
        """Fill every time step of `out` (a SampleBatch whose B equals the number of envs).

        `reset_state` (a recurrent agent's) is told after every step which environments ended
        an episode, so that their state restarts before the next step."""
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
            if reset_state is not None:
                reset_state(out.terminated[t] | out.truncated[t])

    def _step_envs(self, env_action: np.ndarray, out: Any, t: int) -> None:
        # Rewards, flags and episode totals are gathered in lists and written once per time
        # step: a numpy scalar write costs about as much as a CartPole step.
        rewards, terminated, truncated, ended = self._step_each(env_action, out.next_observation[t])
        reward = np.asarray(rewards, dtype=np.float64)
        out.reward[t] = reward
        out.terminated[t] = terminated
        out.truncated[t] = truncated
        self._episode_return += reward
        self._episode_length += 1
        if ended:
            out.completed_return[t, ended] = self._episode_return[ended]
            out.completed_length[t, ended] = self._episode_length[ended]
            self._episode_return[ended] = 0.0
            self._episode_length[ended] = 0

    def _step_each(self, env_action: np.ndarray, next_obs: np.ndarray) -> StepResults:
        """Step every environment once: write its observation after the step into `next_obs`
        and, reset at once where its episode ended, the one the policy sees next into
        `self.observation`. Only what must be per environment happens in this loop."""
        n = len(self.envs)
        rewards: list[Any] = [0.0] * n
        terminated: list[Any] = [False] * n
        truncated: list[Any] = [False] * n
        ended: list[int] = []
        for i, env in enumerate(self.envs):
            obs, rewards[i], terminated[i], truncated[i], _ = env.step(env_action[i])
            next_obs[i] = obs
            if terminated[i] or truncated[i]:
                ended.append(i)
                obs, _ = env.reset()
            self.observation[i] = obs
        return rewards, terminated, truncated, ended

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
