"""`EnvPoolSampler` (`[sampler] kind = "envpool"`): the environments stepped by EnvPool's C++
threads, with the batch, episode and resume semantics of the other samplers.

Each environment is an EnvPool pool of one, stepped through EnvPool's asynchronous interface:
every pool is sent its action, then every pool is received, so the B environments step in
parallel on C++ threads while the policy stays one batched call in this process. One pool per
environment, not one pool of B, because a pool resets an environment only on the step after
its episode ended (spending that step's action on the reset); a pool of one is reset at once,
so `next_observation` holds the terminal observation and `observation` the new episode's
first, as with gymnasium environments (`rlplex.samplers.collector`).

Atari games run EnvPool's own preprocessing, configured from `[env.atari]` (the same frame
skip and max-pooling, screen size, frame stack, no-op starts, episodic life, reward clipping,
FIRE on reset and sticky actions); evaluation still runs the gymnasium pipeline. Other tasks
must be ones EnvPool has under the same id (`envpool.list_all_envs()`), and their spaces must
match gymnasium's, or the config is refused naming the field.

Resume: EnvPool cannot hand out an environment's generator state. A snapshot instead holds a
new seed per environment, derived from its seed and the episodes it has begun, so a resumed
run starts new episodes that never repeat the earlier run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlplex.envs import EnvConfig, EnvSpaces
from rlplex.errors import EnvironmentSpecError
from rlplex.samplers.collector import EnvCollector, StepResults
from rlplex.samplers.rng import streams_digest
from rlplex.samplers.serial import SerialSampler

ENVPOOL_REQUIREMENT = "envpool==1.2.5"
_ONE = np.zeros(1, dtype=np.int32)  # the env_id of a pool's one environment


def import_envpool() -> Any:
    try:
        import envpool
    except ImportError:
        raise EnvironmentSpecError(
            f"field 'sampler.kind': 'envpool' needs EnvPool: pip install {ENVPOOL_REQUIREMENT} "
            "(Linux x86_64, Python < 3.13); or use kind = 'parallel'"
        ) from None
    return envpool


def envpool_task(env: EnvConfig) -> tuple[str, dict[str, Any]]:
    """The EnvPool task id and `envpool.make` options for `env`."""
    options = dict(env.kwargs)
    if env.atari is None:
        return env.id, options
    atari = env.atari
    game = env.id.removeprefix("ALE/")
    if "max_num_frames_per_episode" in options:  # ALE counts emulator frames, EnvPool agent steps
        options["max_episode_steps"] = max(1, int(options.pop("max_num_frames_per_episode")) // atari.frame_skip)
    options = {
        "noop_max": atari.noop_max,
        "frame_skip": atari.frame_skip,
        "img_height": atari.screen_size,
        "img_width": atari.screen_size,
        "stack_num": atari.frame_stack,
        "episodic_life": atari.episodic_life,
        "reward_clip": atari.clip_rewards,
        "use_fire_reset": atari.fire_reset,
        "repeat_action_probability": atari.repeat_action_probability,
        **options,
    }
    return game, options


def pool_maker(env: EnvConfig) -> Callable[[int], Any]:
    """A function of a seed that makes a pool of one of `env`'s environment; the task is checked
    once, here."""
    envpool = import_envpool()
    task, options = envpool_task(env)
    tasks = envpool.list_all_envs()
    if task not in tasks:
        raise EnvironmentSpecError(
            f"field 'env.id': EnvPool has no task {task!r} (sampler.kind = 'envpool'); its tasks include "
            f"{', '.join(sorted(tasks)[:12])}, ...; or use kind = 'parallel'"
        )

    def make(seed: int) -> Any:
        try:
            with warnings.catch_warnings():  # gymnasium on EnvPool's float64 Box bounds: nothing to act on
                warnings.simplefilter("ignore", UserWarning)
                return envpool.make(
                    task, env_type="gymnasium", num_envs=1, batch_size=1, num_threads=1, seed=seed % 2**31, **options
                )
        except (TypeError, ValueError, RuntimeError) as error:
            raise EnvironmentSpecError(
                f"field 'env.kwargs': EnvPool refused {task!r} with {options}: {error}"
            ) from None

    return make


def check_envpool_spaces(env: EnvConfig, spaces: EnvSpaces, pool: Any) -> None:
    """Refuse a task whose EnvPool spaces differ from gymnasium's (the agent is built for those)."""
    with warnings.catch_warnings():  # as in pool_maker
        warnings.simplefilter("ignore", UserWarning)
        space = pool.observation_space
    shape, dtype = tuple(space.shape), str(space.dtype)
    if (shape, dtype) != (spaces.obs_shape, spaces.obs_dtype):
        raise EnvironmentSpecError(
            f"field 'env.id': EnvPool's {env.id!r} observes {dtype} {shape}, gymnasium's {spaces.obs_dtype} "
            f"{spaces.obs_shape}; use sampler.kind = 'parallel'"
        )


class EnvPoolCollector(EnvCollector):
    """`EnvCollector` over pools of one environment: every pool steps at once (send all, then
    receive all); an ended episode is reset at once in its pool."""

    def __init__(self, env: EnvConfig, spaces: EnvSpaces, seeds: list[int]) -> None:
        self._pool_seeds = list(seeds)
        self._episodes = [0] * len(seeds)  # episodes begun per environment since its pool's seed
        self._make_pool = pool_maker(env)
        pools = [self._make_pool(seed) for seed in seeds]
        try:
            check_envpool_spaces(env, spaces, pools[0])
        except EnvironmentSpecError:
            for pool in pools:
                pool.close()
            raise
        super().__init__(pools, spaces, seeds)
        self.pools: list[Any] = self.envs  # the same list: EnvPool pools, not gymnasium environments

    def reset(self) -> None:
        for i, seed in enumerate(self._seeds):
            if seed is not None and seed != self._pool_seeds[i]:  # a resumed run's new seed
                self.pools[i].close()
                self.pools[i] = self._make_pool(seed)
                self._pool_seeds[i], self._episodes[i] = seed, 0
        for pool in self.pools:
            pool.async_reset()
        for i, pool in enumerate(self.pools):
            self.observation[i] = pool.recv()[0][0]
            self._episodes[i] += 1
        self._episode_return[:] = 0
        self._episode_length[:] = 0
        self._started = True

    def _step_each(self, env_action: np.ndarray, next_obs: np.ndarray) -> StepResults:
        n = len(self.pools)
        for i, pool in enumerate(self.pools):
            pool.send(env_action[i : i + 1], _ONE)
        rewards: list[Any] = [0.0] * n
        terminated: list[Any] = [False] * n
        truncated: list[Any] = [False] * n
        ended: list[int] = []
        for i, pool in enumerate(self.pools):
            obs, reward, term, trunc, _ = pool.recv()
            next_obs[i] = obs[0]
            rewards[i], terminated[i], truncated[i] = float(reward[0]), bool(term[0]), bool(trunc[0])
            if terminated[i] or truncated[i]:
                ended.append(i)
                pool.async_reset()
            else:
                self.observation[i] = obs[0]
        for i in ended:
            self.observation[i] = self.pools[i].recv()[0][0]
            self._episodes[i] += 1
        return rewards, terminated, truncated, ended

    def rng_states(self) -> list[Any]:
        """A new seed per environment (an int: `restore_rng_states` reseeds with it)."""
        return [
            int(np.random.SeedSequence(entropy=seed, spawn_key=(episodes,)).generate_state(1, dtype=np.uint32)[0])
            for seed, episodes in zip(self._pool_seeds, self._episodes, strict=True)
        ]

    def restore_rng_states(self, states: Sequence[Any]) -> None:
        # A gymnasium environment's generator state (a snapshot of another sampler kind) cannot
        # be set in a pool: a seed derived from it instead.
        seeds = [s if s is None or isinstance(s, int) else int(streams_digest([s])[:8], 16) for s in states]
        super().restore_rng_states(seeds)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


class EnvPoolSampler(SerialSampler):
    """A `SerialSampler` whose environments EnvPool steps on C++ threads (the module docstring)."""

    def _make_collector(self, spaces: EnvSpaces, seeds: list[int]) -> EnvCollector:
        return EnvPoolCollector(self.env_config, spaces, seeds)
