"""`TrainConfig`: one TOML file describes a classic RL run (env, sampler, agent, algo, runner).

`build_runner` turns a validated config into live objects. Each section is a small model;
the algorithm section is a tagged union on `name`, so a field of another algorithm is an
error rather than silently ignored.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from rlplex.agents import CategoricalPgAgent, DqnAgent, GaussianPgAgent
from rlplex.agents.base import Agent, AgentFactory
from rlplex.algos.dqn import DQN, DQNConfig
from rlplex.algos.ppo import PPO, PPOConfig
from rlplex.config import StrictModel, load_config
from rlplex.envs import EnvConfig, EnvSpaces, probe_spaces
from rlplex.errors import ConfigError
from rlplex.runners.snapshot import SnapshotMode
from rlplex.samplers import Evaluator, SerialSampler
from rlplex.samplers.base import Sampler


class SamplerConfig(StrictModel):
    kind: Literal["serial", "parallel"] = "serial"
    batch_T: int = Field(128, ge=1, description="time steps per environment per batch")
    batch_B: int = Field(8, ge=1, description="environments per rank")
    n_workers: int = Field(2, ge=1, description="worker processes (parallel sampler only)")


class AgentConfig(StrictModel):
    hidden: tuple[int, ...] = (64, 64)
    init_log_std: float = 0.0


class PPOSection(PPOConfig):
    name: Literal["ppo"] = "ppo"


class DQNSection(DQNConfig):
    name: Literal["dqn"]


AlgoSection = Annotated[PPOSection | DQNSection, Field(discriminator="name")]


class RunnerConfig(StrictModel):
    kind: Literal["minibatch", "minibatch_eval", "async", "async_eval"] = "minibatch_eval"
    n_steps: int = Field(100_000, ge=1, description="environment steps over all ranks")
    seed: int = 0
    log_interval_steps: int = Field(10_000, ge=1)
    eval_episodes: int = Field(10, ge=1)
    snapshot_mode: SnapshotMode = "last"
    snapshot_gap: int = Field(1, ge=1)
    stop_at_return: float | None = None
    replay_ratio: float = Field(
        8.0, gt=0, description="async only: ceiling on (updates x batch_size) / env steps sampled"
    )


class TrainConfig(StrictModel):
    env: EnvConfig
    sampler: SamplerConfig = SamplerConfig()
    agent: AgentConfig = AgentConfig()
    algo: AlgoSection = PPOSection()
    runner: RunnerConfig = RunnerConfig()


def load_train_config(path: str | Path) -> TrainConfig:
    return load_config(TrainConfig, path)


def agent_factory(config: TrainConfig, spaces: EnvSpaces) -> AgentFactory:
    """A picklable factory for the agent this config asks for (workers build their own copy)."""
    factory: AgentFactory
    if config.algo.name == "dqn":
        factory = partial(DqnAgent, hidden=config.agent.hidden)
    elif spaces.action_kind == "discrete":
        factory = partial(CategoricalPgAgent, hidden=config.agent.hidden)
    else:
        factory = partial(GaussianPgAgent, hidden=config.agent.hidden, init_log_std=config.agent.init_log_std)
    return factory


def build_sampler(config: TrainConfig) -> Sampler:
    s = config.sampler
    if s.kind == "serial":
        return SerialSampler(config.env, s.batch_T, s.batch_B)
    raise ConfigError(f"field 'sampler.kind': {s.kind!r} is not available yet")


def build_algo(config: TrainConfig) -> Any:
    section = config.algo
    if isinstance(section, DQNSection):
        return DQN(DQNConfig(**section.model_dump(exclude={"name"})), seed=config.runner.seed)
    return PPO(PPOConfig(**section.model_dump(exclude={"name"})))


def build_runner(config: TrainConfig, output_dir: str | Path | None, show_progress: bool = True) -> Any:
    from rlplex.runners.minibatch import MinibatchRl, MinibatchRlEval

    spaces = probe_spaces(config.env)
    r = config.runner
    if r.kind in ("async", "async_eval"):
        return _build_async_runner(config, spaces, output_dir, show_progress)
    agent: Agent = agent_factory(config, spaces)(spaces)
    common: dict[str, Any] = dict(
        n_steps=r.n_steps,
        seed=r.seed,
        log_interval_steps=r.log_interval_steps,
        log_dir=output_dir,
        snapshot_mode=r.snapshot_mode,
        snapshot_gap=r.snapshot_gap,
        stop_at_return=r.stop_at_return,
        show_progress=show_progress,
    )
    algo, sampler = build_algo(config), build_sampler(config)
    if r.kind == "minibatch":
        return MinibatchRl(algo, agent, sampler, **common)
    return MinibatchRlEval(
        algo, agent, sampler, evaluator=Evaluator(config.env, r.eval_episodes, seed=r.seed), **common
    )


def _build_async_runner(config: TrainConfig, spaces: EnvSpaces, output_dir: str | Path | None, show: bool) -> Any:
    from rlplex.runners.async_ import AsyncRl, AsyncRlEval

    r = config.runner
    if config.algo.name != "dqn":
        raise ConfigError(f"field 'runner.kind': {r.kind!r} needs an off-policy algorithm (algo.name = 'dqn')")
    args: dict[str, Any] = dict(
        algo=build_algo(config),
        agent_factory=agent_factory(config, spaces),
        env=config.env,
        batch_T=config.sampler.batch_T,
        batch_B=config.sampler.batch_B,
        n_steps=r.n_steps,
        replay_ratio=r.replay_ratio,
        seed=r.seed,
        log_interval_steps=r.log_interval_steps,
        log_dir=output_dir,
        snapshot_mode=r.snapshot_mode,
        snapshot_gap=r.snapshot_gap,
        stop_at_return=r.stop_at_return,
        show_progress=show,
    )
    if r.kind == "async":
        return AsyncRl(**args)
    return AsyncRlEval(**args, evaluator=Evaluator(config.env, r.eval_episodes, seed=r.seed))
