"""Atari through `ale-py` with the standard (Nature DQN / SB3 `AtariWrapper`) preprocessing.

    ALE/<Game>-v5 (frameskip=1) -> AtariPreprocessing (no-op starts, frame skip with a max over
    the last two frames, 84x84 grey) -> EpisodicLife* -> FireReset -> sign(reward)* ->
    FrameStackObservation(4)                                     (* training environments only)

Observations stay uint8 (4, 84, 84) all the way to the model, which scales them to [0, 1];
a float copy would take 4x the memory in every batch and replay slot.

Episodic life is the DeepMind variant, not gymnasium's `terminal_on_life_loss` (which resets
the whole game on a life loss, so an agent would never see the game's later stages): a lost
life ends the *training* episode, but the next `reset` only continues the game with a no-op
step; the game itself restarts when it is really over. Evaluation environments play whole
games with unclipped rewards, so evaluation returns are the game's scores.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.errors import EnvironmentSpecError

EnvMode = Literal["train", "eval"]


class AtariConfig(StrictModel):
    noop_max: int = Field(30, ge=0, description="up to this many no-op actions at the start of a game")
    frame_skip: int = Field(4, ge=1, description="emulator frames per agent step (max-pooled over the last two)")
    screen_size: int = Field(84, ge=36, description="observations are screen_size x screen_size grey frames")
    frame_stack: int = Field(4, ge=1, description="the last this many frames form one observation (C, H, W)")
    episodic_life: bool = Field(True, description="training only: a lost life ends the episode (not the game)")
    clip_rewards: bool = Field(True, description="training only: rewards become their sign (-1, 0, 1)")
    fire_reset: bool = Field(True, description="press FIRE after a reset, in games that need it (Breakout)")
    repeat_action_probability: float = Field(
        0.0, ge=0, le=1, description="sticky actions (ALE v5 default 0.25); 0 = the Nature DQN setting"
    )


class EpisodicLife(gym.Wrapper[np.ndarray, int, np.ndarray, int]):
    """A lost life is a terminal step; `reset` then continues the game unless it is over."""

    def __init__(self, env: gym.Env[np.ndarray, int]) -> None:
        super().__init__(env)
        self._lives = 0
        self._game_over = True

    def _ale_lives(self) -> int:
        return int(self.env.unwrapped.ale.lives())  # type: ignore[attr-defined]

    def step(self, action: int) -> tuple[np.ndarray, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._game_over = terminated or truncated
        lives = self._ale_lives()
        # lives > 0: some games report 0 lives before the real game over; the game's own
        # `terminated` covers that step.
        if 0 < lives < self._lives:
            terminated = True
        self._lives = lives
        return obs, reward, terminated, truncated, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if self._game_over or seed is not None:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)  # a no-op step past the lost life
            if terminated or truncated:
                obs, info = self.env.reset(options=options)
        self._game_over = False
        self._lives = self._ale_lives()
        return obs, info


class FireReset(gym.Wrapper[np.ndarray, int, np.ndarray, int]):
    """Press FIRE (then UP) after a reset: some games (Breakout) do not start otherwise."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self.env.reset(seed=seed, options=options)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(options=options)
        return obs, info


def _sign(reward: Any) -> float:
    return float(np.sign(float(reward)))


def register_ale() -> None:
    try:
        import ale_py
    except ImportError:
        raise EnvironmentSpecError(
            "Atari environments need ale-py: pip install ale-py==0.12.1 (its ROMs ship with the package)"
        ) from None
    gym.register_envs(ale_py)


def make_atari(
    env_id: str, kwargs: dict[str, Any], atari: AtariConfig, mode: EnvMode, render_mode: str | None
) -> gym.Env[Any, Any]:
    """The preprocessed game; `mode` 'eval' leaves out episodic life and reward clipping."""
    for key in ("frameskip", "obs_type"):
        if key in kwargs:
            raise EnvironmentSpecError(
                f"field 'env.kwargs': {key!r} is set by [env.atari] (frames are skipped by the preprocessing, "
                f"observations are grey frames); remove {key}={kwargs[key]!r}"
            )
    options = {"repeat_action_probability": atari.repeat_action_probability, **kwargs}
    env: gym.Env[Any, Any] = gym.make(env_id, render_mode=render_mode, frameskip=1, **options)
    env = gym.wrappers.AtariPreprocessing(
        env, noop_max=atari.noop_max, frame_skip=atari.frame_skip, screen_size=atari.screen_size
    )
    if mode == "train" and atari.episodic_life:
        env = EpisodicLife(env)
    game: Any = env.unwrapped  # an ale_py AtariEnv
    meanings = game.get_action_meanings()
    if atari.fire_reset and len(meanings) >= 3 and meanings[1] == "FIRE":
        env = FireReset(env)
    if mode == "train" and atari.clip_rewards:
        env = gym.wrappers.TransformReward(env, _sign)
    return gym.wrappers.FrameStackObservation(env, atari.frame_stack)
