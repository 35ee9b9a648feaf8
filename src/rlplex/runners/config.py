"""`TrainConfig`: one TOML file describes a classic RL run (env, sampler, agent, algo, runner).

`build_runner` turns a validated config into live objects. Each section is a small model;
the algorithm section is a tagged union on `name`, so a field of another algorithm is an
error rather than silently ignored.
"""

from __future__ import annotations

import itertools
import math
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field

from rlplex.agents import CategoricalPgAgent, DdpgAgent, DqnAgent, GaussianPgAgent, SacAgent
from rlplex.agents.base import Agent, AgentFactory
from rlplex.agents.recurrent import R2d1Agent, RecurrentCategoricalPgAgent
from rlplex.algos.a2c import A2C, A2CConfig
from rlplex.algos.dqn import DQN, DQNConfig
from rlplex.algos.ppo import PPO, PPOConfig
from rlplex.algos.r2d1 import R2D1, R2D1Config
from rlplex.algos.sac import SAC, SACConfig
from rlplex.algos.td3 import TD3, DDPGConfig, TD3Config
from rlplex.config import StrictModel, load_config
from rlplex.diagnostics.trackers import LoggingConfig, Tracking
from rlplex.envs import EnvConfig, EnvSpaces, describe_action_space, describe_observation_space, probe_spaces
from rlplex.errors import ConfigError
from rlplex.io.snapshot import SnapshotMode
from rlplex.models.device import resolve_device
from rlplex.models.encoders import NATURE_FEATURES, EncoderKind, choose_encoder, nature_cnn_parameters
from rlplex.models.spec import Device
from rlplex.replays.uniform import stacks_frames
from rlplex.samplers import Evaluator, ParallelSampler, SerialSampler
from rlplex.samplers.base import Sampler


class SamplerConfig(StrictModel):
    kind: Literal["serial", "parallel", "envpool"] = Field(
        "serial",
        description="serial: in this process; parallel: in worker processes; envpool: on EnvPool's C++ threads "
        "(where envpool installs: Atari games and the tasks EnvPool has under the same id)",
    )
    batch_T: int = Field(128, ge=1, description="time steps per environment per batch")
    batch_B: int = Field(8, ge=1, description="environments per rank")
    n_workers: int = Field(
        2, ge=1, description="worker processes (parallel sampler only; under async runners, behind the double buffer)"
    )


class AgentConfig(StrictModel):
    hidden: tuple[Annotated[int, Field(ge=1)], ...] | None = Field(
        None, description="hidden layer widths after the encoder; default (64, 64), or none after the CNN"
    )
    encoder: EncoderKind = Field(
        "auto", description="auto: the Nature CNN for image observations (uint8 (C,H,W)/(H,W,C)), else an MLP"
    )
    init_log_std: float = Field(
        0.0, description="log std the Gaussian policy starts from (PPO, A2C with Box actions); learned from there"
    )
    lstm_size: int | None = Field(
        None,
        ge=1,
        description="a recurrent agent: an LSTM of this size after the hidden layers (PPO, A2C with Discrete "
        "actions; R2D1 always has one, 64 by default); none: feed-forward",
    )


class PPOSection(PPOConfig):
    name: Literal["ppo"] = Field("ppo", description="selects PPO (no [algo] section at all: PPO with its defaults)")


class DQNSection(DQNConfig):
    name: Literal["dqn"] = Field(description="selects DQN")


class A2CSection(A2CConfig):
    name: Literal["a2c"] = Field(description="selects A2C")


class SACSection(SACConfig):
    name: Literal["sac"] = Field(description="selects SAC")


class TD3Section(TD3Config):
    name: Literal["td3"] = Field(description="selects TD3")


class DDPGSection(DDPGConfig):
    name: Literal["ddpg"] = Field(description="selects DDPG")


class R2D1Section(R2D1Config):
    name: Literal["r2d1"] = Field(description="selects R2D1")


AlgoSection = Annotated[
    PPOSection | DQNSection | A2CSection | SACSection | TD3Section | DDPGSection | R2D1Section,
    Field(discriminator="name"),
]
# Replay-based: they run under AsyncRl; SAC/TD3/DDPG critics live outside the agent's model,
# so SyncRl's DDP would not keep them equal across ranks.
OFF_POLICY = ("dqn", "sac", "td3", "ddpg", "r2d1")
RECURRENT = ("ppo", "a2c", "r2d1")  # the algorithms that take `agent.lstm_size`
ACTOR_CRITIC_REPLAY = ("sac", "td3", "ddpg")
ASYNC_KINDS = ("async", "async_eval")


class RunnerConfig(StrictModel):
    kind: Literal["minibatch", "minibatch_eval", "sync", "sync_eval", "async", "async_eval"] = Field(
        "minibatch_eval",
        description="minibatch: one process; sync: world_size ranks with gradients all-reduced; async: sampling "
        "and optimization in separate processes (off-policy algorithms only); *_eval: also evaluation episodes "
        "(deterministic actions) at each log row, whose mean return stop_at_return then uses",
    )
    n_steps: int = Field(100_000, ge=1, description="environment steps over all ranks")
    seed: int = Field(
        0, description="base seed of the environments, the initial weights and the random streams (per rank)"
    )
    log_interval_steps: int = Field(
        10_000, ge=1, description="environment steps between log rows; each row also offers a snapshot"
    )
    eval_episodes: int = Field(10, ge=1, description="*_eval kinds: evaluation episodes at each log row")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="steps over which linear schedules (learning rate, clip, epsilon) run; default: n_steps of the "
        "run's first start (a resume keeps its snapshot's horizon unless this is set)",
    )
    snapshot_mode: SnapshotMode = Field(
        "last",
        description="snapshots at log rows: last (only the newest kept), all, gap (every snapshot_gap iterations), "
        "none",
    )
    snapshot_gap: int = Field(1, ge=1, description="snapshot_mode = 'gap': a snapshot every this many iterations")
    stop_at_return: float | None = Field(
        None,
        description="stop once a log row's mean return (of evaluation episodes under *_eval kinds, else of "
        "training episodes) reaches this; none: run all n_steps",
    )
    world_size: int = Field(2, ge=1, description="ranks (sync kinds only)")
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend of the sync kinds; nccl needs the model on a GPU"
    )
    device: Device = Field(
        "auto",
        description="where the model and its training batches live: auto = CUDA when torch sees a GPU, else the "
        "CPU; cuda without a GPU is an error. Under sync kinds rank r takes GPU r modulo the GPUs there are",
    )
    global_batch: bool = Field(
        False, description="sync kinds: divide sampler.batch_B and algo.minibatch_size by world_size (else per rank)"
    )
    replay_ratio: float = Field(
        8.0, gt=0, description="async only: ceiling on (updates x batch_size) / env steps sampled"
    )
    min_replay_ratio: float | None = Field(
        None,
        gt=0,
        description="async only: floor on the same ratio, held by making the sampler wait for a slow optimizer "
        "(at most replay_ratio); none: the sampler never waits",
    )


class TrainConfig(StrictModel):
    env: EnvConfig = Field(description="the gymnasium environment to train on")
    sampler: SamplerConfig = Field(SamplerConfig(), description="how environment steps are collected")
    agent: AgentConfig = Field(AgentConfig(), description="the agent's network")
    algo: AlgoSection = Field(
        PPOSection(),
        description="the algorithm and its settings, chosen by algo.name (ppo, dqn, a2c, sac, td3, ddpg, r2d1); "
        "default: PPO with its defaults",
    )
    runner: RunnerConfig = Field(
        RunnerConfig(), description="the training loop: its kind, length, seed, log rows, snapshots and device"
    )
    logging: LoggingConfig = Field(
        LoggingConfig(), description="the trackers metrics go to (TensorBoard, W&B) and the progress lines"
    )


def load_train_config(path: str | Path) -> TrainConfig:
    return load_config(TrainConfig, path)


# Parameters, gradients and Adam's two moments, float32.
BYTES_PER_PARAMETER = 16


def check_fits_in_memory(config: TrainConfig, spaces: EnvSpaces, available_bytes: int, source: str) -> None:
    """Refuse an agent whose networks cannot fit in memory, before anything is allocated (a
    layer of 1e9 units would otherwise end in an allocator traceback)."""
    outputs = spaces.n_actions if spaces.action_kind == "discrete" else math.prod(spaces.action_shape)
    cnn = (
        config.algo.name not in ACTOR_CRITIC_REPLAY
        and choose_encoder(spaces, config.agent.encoder, f"field 'agent.encoder': {config.algo.name.upper()}'s agent")
        == "cnn"
    )
    hidden = config.agent.hidden if config.agent.hidden is not None else () if cnn else (64, 64)
    in_dim = NATURE_FEATURES if cnn else max(1, math.prod(spaces.obs_shape))
    widths = [in_dim, *hidden, max(1, outputs)]
    layer_params = sum((a + 1) * b for a, b in itertools.pairwise(widths))
    layer_params += nature_cnn_parameters(spaces) if cnn else 0
    # A policy and a value network (PPO), or a Q-network and its target (DQN), at least.
    needed = 2 * layer_params * BYTES_PER_PARAMETER
    if needed > available_bytes:
        raise ConfigError(
            f"{source}: field 'agent.hidden': {list(hidden)} needs at least {needed / 2**30:,.1f} GiB "
            f"for the networks' parameters and optimizer state; this machine has {available_bytes / 2**30:,.1f} GiB"
        )
    buffer_size = getattr(config.algo, "buffer_size", 0)
    # Each slot holds an observation and the next one, or of stacked frames the newest frame of
    # each (uint8 frames: a byte a pixel).
    stored_shape = spaces.obs_shape[1:] if stacks_frames(spaces) else spaces.obs_shape
    per_slot = 2 * math.prod(stored_shape)
    replay = buffer_size * per_slot * np.dtype(spaces.obs_dtype).itemsize
    if needed + replay > available_bytes:
        raise ConfigError(
            f"{source}: field 'algo.buffer_size': {buffer_size:,} transitions of {describe_observation_space(spaces)} "
            f"observations need {replay / 2**30:,.1f} GiB of replay; this machine has "
            f"{available_bytes / 2**30:,.1f} GiB"
        )


def agent_factory(config: TrainConfig, spaces: EnvSpaces) -> AgentFactory:
    """A picklable factory for the agent this config asks for (workers build their own copy)."""
    factory: AgentFactory
    name, lstm_size = config.algo.name, config.agent.lstm_size
    hidden, encoder = config.agent.hidden, config.agent.encoder
    mlp_hidden = (64, 64) if hidden is None else hidden  # agents without the CNN encoder
    if lstm_size is not None and name not in RECURRENT:
        raise ConfigError(
            f"field 'agent.lstm_size': recurrent agents are for algo.name one of {', '.join(RECURRENT)} "
            f"(got {name!r}); leave it unset"
        )
    if isinstance(config.algo, R2D1Section):
        factory = partial(R2d1Agent, hidden=mlp_hidden, lstm_size=lstm_size or 64, dueling=config.algo.dueling)
    elif lstm_size is not None:
        if spaces.action_kind != "discrete":
            raise ConfigError(
                f"field 'agent.lstm_size': the recurrent agent needs a Discrete action space; {config.env.id!r} has "
                f"{describe_action_space(spaces)}"
            )
        factory = partial(RecurrentCategoricalPgAgent, hidden=mlp_hidden, lstm_size=lstm_size)
    elif isinstance(config.algo, DQNSection):
        factory = partial(DqnAgent, hidden=hidden, encoder=encoder, **config.algo.agent_options())
    elif name == "sac":
        factory = partial(SacAgent, hidden=(64, 64) if hidden is None else hidden)
    elif name in ("td3", "ddpg"):
        factory = partial(DdpgAgent, hidden=(64, 64) if hidden is None else hidden)
    elif spaces.action_kind == "discrete":
        factory = partial(CategoricalPgAgent, hidden=hidden, encoder=encoder)
    else:
        factory = partial(GaussianPgAgent, hidden=hidden, init_log_std=config.agent.init_log_std, encoder=encoder)
    return factory


# What each algorithm's agent acts in; PPO and A2C handle both kinds.
ACTION_KINDS: dict[str, tuple[str, str]] = {  # algo.name: (action kind, the space's name)
    "dqn": ("discrete", "a Discrete"),
    "r2d1": ("discrete", "a Discrete"),
    "sac": ("continuous", "a Box"),
    "td3": ("continuous", "a Box"),
    "ddpg": ("continuous", "a Box"),
}


def check_action_space(config: TrainConfig, spaces: EnvSpaces) -> None:
    """Refuse an algorithm the environment's action space does not suit, before anything is built."""
    name = config.algo.name
    if name not in ACTION_KINDS or ACTION_KINDS[name][0] == spaces.action_kind:
        return
    suited = [other for other, (kind, _) in ACTION_KINDS.items() if kind == spaces.action_kind]
    raise ConfigError(
        f"field 'algo.name': {name.upper()} needs {ACTION_KINDS[name][1]} action space, but {config.env.id!r} has "
        f"{describe_action_space(spaces)}; use one of {', '.join(['ppo', 'a2c', *suited])}"
    )


def cpu_advice(config: TrainConfig, spaces: EnvSpaces, device: torch.device) -> str | None:
    """A hint when "auto" put an on-policy MLP agent on a GPU: acting is one small forward pass
    per step, so the transfers cost more than the GPU saves (SB3 warns likewise)."""
    if device.type != "cuda" or config.runner.device != "auto" or config.algo.name not in ("ppo", "a2c"):
        return None
    if choose_encoder(spaces, config.agent.encoder, config.algo.name) == "cnn":
        return None
    return (
        f"note: {config.algo.name} with an MLP agent trains on the GPU (runner.device = 'auto' found one); "
        "on vector observations the CPU is usually faster: --device cpu"
    )


def check_observation_space(config: TrainConfig, spaces: EnvSpaces) -> None:
    """Refuse observations the algorithm's agent cannot read, before anything is built (a
    multi-dimensional Box used to pass here and fail at the first forward pass)."""
    name = config.algo.name
    if name in ACTOR_CRITIC_REPLAY:
        if config.agent.encoder == "cnn" or len(spaces.obs_shape) != 1 or spaces.obs_dtype != "float32":
            raise ConfigError(
                f"field 'env': {name.upper()} needs a 1-D float Box observation space (its actor and critics have "
                f"no image encoder), but {config.env.id!r} has {describe_observation_space(spaces)}; "
                "use ppo, a2c or dqn for images"
            )
        return
    if name == "r2d1" or config.agent.lstm_size is not None:
        if config.agent.encoder == "cnn" or len(spaces.obs_shape) != 1 or spaces.obs_dtype != "float32":
            raise ConfigError(
                f"field 'env': the recurrent agent of {name.upper()} needs a 1-D float Box observation space (its "
                f"LSTM has no image encoder yet), but {config.env.id!r} has {describe_observation_space(spaces)}"
            )
        return
    choose_encoder(spaces, config.agent.encoder, f"field 'agent.encoder': {name.upper()}'s agent")


def build_sampler(config: TrainConfig) -> Sampler:
    s = config.sampler
    if s.kind == "serial":
        return SerialSampler(config.env, s.batch_T, s.batch_B)
    if s.kind == "parallel":
        factory = agent_factory(config, probe_spaces(config.env))
        return ParallelSampler(config.env, s.batch_T, s.batch_B, s.n_workers, agent_factory=factory)
    if s.kind == "envpool":
        from rlplex.samplers.envpool_ import EnvPoolSampler

        return EnvPoolSampler(config.env, s.batch_T, s.batch_B)
    raise ConfigError(f"field 'sampler.kind': unknown sampler kind {s.kind!r}")


def build_algo(config: TrainConfig) -> Any:
    section, seed = config.algo, config.runner.seed
    fields = section.model_dump(exclude={"name"})
    if isinstance(section, DQNSection):
        return DQN(DQNConfig(**fields), seed=seed)
    if isinstance(section, R2D1Section):
        return R2D1(R2D1Config(**fields), seed=seed)
    if isinstance(section, SACSection):
        return SAC(SACConfig(**fields), seed=seed)
    if isinstance(section, DDPGSection):
        return TD3(DDPGConfig(**fields), seed=seed)
    if isinstance(section, TD3Section):
        return TD3(TD3Config(**fields), seed=seed)
    if isinstance(section, A2CSection):
        return A2C(A2CConfig(**fields))
    return PPO(PPOConfig(**fields))


def _refuse_sync_for_replay_actor_critics(config: TrainConfig) -> None:
    kind = config.runner.kind
    if kind in ("sync", "sync_eval") and config.algo.name in ACTOR_CRITIC_REPLAY:
        raise ConfigError(
            f"field 'runner.kind': {kind!r} is not supported for algo.name = {config.algo.name!r} (its critics "
            "are outside the agent's model, so ranks would drift apart); use minibatch(_eval) or async(_eval)"
        )


def build_runner(config: TrainConfig, output_dir: str | Path | None, show_progress: bool = True) -> Any:
    r = config.runner
    _refuse_sync_for_replay_actor_critics(config)
    if r.kind in ("sync", "sync_eval"):
        from rlplex.runners.sync import SyncLauncher

        spaces = probe_spaces(config.env)
        check_action_space(config, spaces)  # here, not as a failure of every rank
        check_observation_space(config, spaces)
        if r.global_batch:
            config = _global_batch_config(config)
        check_sync_device(r.device, r.backend)  # here, not as a failure of every rank
        build = partial(build_sync_rank, config, None if output_dir is None else str(output_dir), show_progress)
        return SyncLauncher(build, world_size=r.world_size, backend=r.backend)
    return build_rank_runner(config, output_dir, show_progress)


def check_sync_device(device: str, backend: str) -> None:
    """A GPU asked for where there is none, or nccl (GPU collectives) for a model on the CPU."""
    resolved = resolve_device(device, "runner.device")
    if backend == "nccl" and resolved.type != "cuda":
        raise ConfigError(
            f"field 'runner.backend': 'nccl' needs the model on a GPU, but runner.device = {device!r} puts it on "
            f'{resolved}; use backend = "gloo" (or a GPU machine with device = "auto" or "cuda")'
        )


def build_sync_rank(
    config: TrainConfig, output_dir: str | None, show_progress: bool, rank: int, world_size: int
) -> Any:
    """The runner of one `SyncLauncher` rank (module-level so that a partial of it pickles)."""
    return build_rank_runner(config, output_dir, show_progress, rank, world_size)


def _global_batch_config(config: TrainConfig) -> TrainConfig:
    w = config.runner.world_size
    s, a = config.sampler, config.algo
    if not isinstance(a, PPOSection):
        raise ConfigError(f"field 'runner.global_batch': supported for algo.name = 'ppo' only (got {a.name!r})")
    for field, value in (("sampler.batch_B", s.batch_B), ("algo.minibatch_size", a.minibatch_size)):
        if value % w:
            raise ConfigError(
                f"field '{field}': {value} is not divisible by runner.world_size={w} (runner.global_batch = true)"
            )
    return config.model_copy(
        update={
            "sampler": s.model_copy(update={"batch_B": s.batch_B // w}),
            "algo": a.model_copy(update={"minibatch_size": a.minibatch_size // w}),
        }
    )


def build_rank_runner(
    config: TrainConfig, output_dir: str | Path | None, show_progress: bool = True, rank: int = 0, world_size: int = 1
) -> Any:
    runner = _build_rank_runner(config, output_dir, show_progress, rank, world_size)
    # The trackers of `[logging]`, opened by the runner with its metrics logger (rank 0's).
    name = Path(output_dir).name if output_dir is not None else "run"
    runner.tracking = Tracking(config.logging, name, config.model_dump(mode="json"))
    return runner


def _build_rank_runner(
    config: TrainConfig, output_dir: str | Path | None, show_progress: bool, rank: int, world_size: int
) -> Any:
    from rlplex.runners.minibatch import MinibatchRl, MinibatchRlEval
    from rlplex.runners.sync import SyncRl, SyncRlEval

    r = config.runner
    if r.kind in ("sync", "sync_eval") and getattr(config.algo, "target_kl", None) is not None:
        # Ranks would stop their epochs after different numbers of backward passes: DDP deadlock.
        raise ConfigError("field 'algo.target_kl': not supported with runner.kind sync/sync_eval; leave it unset")
    _refuse_sync_for_replay_actor_critics(config)
    spaces = probe_spaces(config.env)
    check_action_space(config, spaces)
    check_observation_space(config, spaces)
    if r.kind in ASYNC_KINDS:
        return _build_async_runner(config, spaces, output_dir, show_progress)
    # The initial weights come from torch's global generator, which a process starts with a
    # random seed: without this, two runs of one config and seed started from different weights.
    # Per rank, like the runner's own seeding (SyncRl's DDP then gives every rank rank 0's).
    torch.manual_seed(r.seed + rank)
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
        schedule_steps=r.schedule_steps,
        rank=rank,
        world_size=world_size,
        device=r.device,
    )
    algo, sampler = build_algo(config), build_sampler(config)
    if r.kind in ("minibatch", "sync"):
        return (SyncRl if r.kind == "sync" else MinibatchRl)(algo, agent, sampler, **common)
    evaluator = Evaluator(config.env, r.eval_episodes, seed=r.seed)
    eval_cls = SyncRlEval if r.kind == "sync_eval" else MinibatchRlEval
    return eval_cls(algo, agent, sampler, evaluator=evaluator, **common)


def _build_async_runner(config: TrainConfig, spaces: EnvSpaces, output_dir: str | Path | None, show: bool) -> Any:
    from rlplex.runners.async_ import AsyncRl, AsyncRlEval

    r = config.runner
    if config.algo.name not in OFF_POLICY:
        raise ConfigError(
            f"field 'runner.kind': {r.kind!r} needs an off-policy algorithm (algo.name one of {', '.join(OFF_POLICY)})"
        )
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
        schedule_steps=r.schedule_steps,
        n_workers=config.sampler.n_workers if config.sampler.kind == "parallel" else None,
        envpool=config.sampler.kind == "envpool",
        device=r.device,
        min_replay_ratio=r.min_replay_ratio,
    )
    if r.kind == "async":
        return AsyncRl(**args)
    return AsyncRlEval(**args, evaluator=Evaluator(config.env, r.eval_episodes, seed=r.seed))
