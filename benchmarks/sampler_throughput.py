"""Env steps/s of 16 CartPole-v1 environments on this machine's cores, four ways, in one run.

    python -m benchmarks.sampler_throughput [--quick]
    python -m benchmarks.sampler_throughput --atari [--quick]

(a) random actions and (b) a small MLP agent (CategoricalPgAgent, 64x64) for:
rlplex ParallelSampler (2 workers, inference in the workers), rlplex SerialSampler (one
process), gymnasium AsyncVectorEnv and stable-baselines3 SubprocVecEnv (one process per env,
inference in the main process once per step over all 16 envs). Every contender runs the same
number of env steps; start-up and a warm-up are not timed. The goal (issue 2) is
ParallelSampler >= 1.5x the faster of AsyncVectorEnv and SubprocVecEnv.
Writes bench_results/sampler_throughput.json.

`--atari`: 8 ALE/Pong-v5 environments with the standard preprocessing ([env.atari]: frame
skip 4, so frames/s = 4 x steps/s), random actions and the Nature-CNN agent
(CategoricalPgAgent), for the rlplex samplers, gymnasium's AsyncVectorEnv over the same
rlplex-made environments, and EnvPool (its own C++ Atari preprocessing, stepped from this
process; skipped when `envpool` does not import). The goal (issue 15) is ParallelSampler >=
1.5x AsyncVectorEnv. Writes bench_results/sampler_throughput_atari.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rlplex.agents import CategoricalPgAgent, RandomAgent
from rlplex.agents.base import Agent, AgentFactory
from rlplex.envs import AtariConfig, EnvConfig, make_env, probe_spaces
from rlplex.samplers import ParallelSampler, SerialSampler

ENV_ID = "CartPole-v1"
N_ENVS = 16
N_WORKERS = 2
BATCH_T = 256
AGENTS: dict[str, AgentFactory] = {"random": RandomAgent, "mlp": partial(CategoricalPgAgent, hidden=(64, 64))}
ATARI = EnvConfig(id="ALE/Pong-v5", atari=AtariConfig())
ATARI_ENVS = 8
ATARI_BATCH_T = 64
ATARI_AGENTS: dict[str, AgentFactory] = {"random": RandomAgent, "cnn": CategoricalPgAgent}


def bench_rlplex(
    kind: str, factory: AgentFactory, n_batches: int, env: EnvConfig | None = None, n_envs: int = N_ENVS,
    batch_T: int = BATCH_T,
) -> float:  # fmt: skip
    env = env or EnvConfig(id=ENV_ID)
    agent = factory(probe_spaces(env))
    sampler: ParallelSampler | SerialSampler
    if kind == "parallel":
        sampler = ParallelSampler(env, batch_T, n_envs, N_WORKERS, agent_factory=factory)
    else:
        sampler = SerialSampler(env, batch_T, n_envs)
    sampler.initialize(agent, seed=0)
    try:
        sampler.obtain_samples(0)  # warm-up
        t0 = time.perf_counter()
        for itr in range(1, n_batches + 1):
            sampler.obtain_samples(itr)
        return n_batches * batch_T * n_envs / (time.perf_counter() - t0)
    finally:
        sampler.shutdown()


def _main_process_policy(factory: AgentFactory, env: EnvConfig | None = None) -> Callable[[np.ndarray], np.ndarray]:
    agent: Agent = factory(probe_spaces(env or EnvConfig(id=ENV_ID)))
    # Images stay uint8 (the CNN scales them); vectors become float32.
    return lambda obs: agent.step(obs if obs.dtype == np.uint8 else np.asarray(obs, dtype=np.float32))[0]


def bench_vec_env(
    kind: str, factory: AgentFactory, n_steps_per_env: int, env: EnvConfig | None = None, n_envs: int = N_ENVS
) -> float:
    policy = _main_process_policy(factory, env)
    fns: list[Callable[[], Any]] = [partial(gym.make, ENV_ID) for _ in range(n_envs)]
    if env is not None:
        fns = [partial(make_env, env) for _ in range(n_envs)]
    if kind == "envpool":
        envs, step = _envpool(n_envs)
        obs = envs.reset()[0]
    elif kind == "gym_async":
        envs: Any = gym.vector.AsyncVectorEnv(fns)
        obs, _ = envs.reset(seed=0)

        def step(actions: np.ndarray) -> Any:
            return envs.step(actions)[0]
    else:
        from stable_baselines3.common.vec_env import SubprocVecEnv

        envs = SubprocVecEnv(fns)  # type: ignore[arg-type]
        envs.seed(0)
        obs = envs.reset()

        def step(actions: np.ndarray) -> Any:
            return envs.step(actions)[0]

    try:
        for _ in range(20):  # warm-up
            obs = step(policy(obs))
        t0 = time.perf_counter()
        for _ in range(n_steps_per_env):
            obs = step(policy(obs))
        return n_steps_per_env * n_envs / (time.perf_counter() - t0)
    finally:
        envs.close()


def _envpool(n_envs: int) -> tuple[Any, Callable[[np.ndarray], Any]]:
    """EnvPool's Pong with the settings of rlplex's [env.atari] (its threads: one per core)."""
    import envpool

    a = ATARI.atari
    assert a is not None
    envs = envpool.make(
        "Pong-v5", env_type="gymnasium", num_envs=n_envs, batch_size=n_envs, num_threads=os.cpu_count() or 1, seed=0,
        episodic_life=a.episodic_life, reward_clip=a.clip_rewards, stack_num=a.frame_stack, noop_max=a.noop_max,
        frame_skip=a.frame_skip, img_height=a.screen_size, img_width=a.screen_size,
        repeat_action_probability=a.repeat_action_probability,
    )  # fmt: skip
    return envs, lambda actions: envs.step(actions)[0]


def envpool_available() -> bool:
    try:
        import envpool  # noqa: F401
    except Exception:  # a missing or broken build: skip the contender
        return False
    return True


def atari_main(quick: bool, n_batches: int | None) -> None:
    """8 preprocessed Pong environments: rlplex samplers vs AsyncVectorEnv (and EnvPool)."""
    n_batches = n_batches or (2 if quick else 10)
    steps_per_env = n_batches * ATARI_BATCH_T
    frame_skip = ATARI.atari.frame_skip if ATARI.atari else 1
    contenders: dict[str, Callable[[AgentFactory], float]] = {
        "rlplex_parallel": lambda f: bench_rlplex("parallel", f, n_batches, ATARI, ATARI_ENVS, ATARI_BATCH_T),
        "rlplex_serial": lambda f: bench_rlplex("serial", f, n_batches, ATARI, ATARI_ENVS, ATARI_BATCH_T),
        "gym_async_vector_env": lambda f: bench_vec_env("gym_async", f, steps_per_env, ATARI, ATARI_ENVS),
    }
    if envpool_available():
        contenders["envpool"] = lambda f: bench_vec_env("envpool", f, steps_per_env, ATARI, ATARI_ENVS)
    else:
        print("  envpool does not import: skipped")
    load_before = os.getloadavg()
    results: dict[str, dict[str, float]] = {}
    for agent_name, factory in ATARI_AGENTS.items():
        results[agent_name] = {}
        for name, run in contenders.items():
            results[agent_name][name] = run(factory) * frame_skip
            print(f"  {agent_name:6s} {name:22s} {results[agent_name][name]:>10,.0f} frames/s", flush=True)
    ratios = {a: r["rlplex_parallel"] / r["gym_async_vector_env"] for a, r in results.items()}
    print(f"\nframes/s (= {frame_skip} x agent steps/s), {ATARI_ENVS} x {ATARI.id} preprocessed, "
          f"{steps_per_env * ATARI_ENVS:,} agent steps each, {os.cpu_count()} cores")  # fmt: skip
    print(f"{'contender':24s}" + "".join(f"{a:>12s}" for a in ATARI_AGENTS))
    for name in contenders:
        print(f"{name:24s}" + "".join(f"{results[a][name]:>12,.0f}" for a in ATARI_AGENTS))
    print(
        f"{'parallel / AsyncVectorEnv':24s}"
        + "".join(f"{ratios[a]:>11.2f}x" for a in ATARI_AGENTS)
        + "  (goal >= 1.5x)"
    )
    out = Path("bench_results") / "sampler_throughput_atari.json"
    out.parent.mkdir(exist_ok=True)
    payload = {
        "env": ATARI.model_dump(),
        "n_envs": ATARI_ENVS,
        "n_workers": N_WORKERS,
        "batch_T": ATARI_BATCH_T,
        "agent_steps_per_contender": steps_per_env * ATARI_ENVS,
        "frames_per_s": results,
        "ratio_parallel_to_async_vector_env": ratios,
        "goal_ratio": 1.5,
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "gymnasium": gym.__version__,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (about 16k steps per contender)")
    parser.add_argument("--batches", type=int, default=None, help=f"batches of {BATCH_T}x{N_ENVS} steps each")
    parser.add_argument("--atari", action="store_true", help=f"{ATARI_ENVS} x preprocessed Pong instead of CartPole")
    args = parser.parse_args()
    torch.set_num_threads(1)  # every contender gets one intra-op thread in its inference process
    if args.atari:
        atari_main(args.quick, args.batches)
        return
    n_batches = args.batches or (4 if args.quick else 40)
    n_steps = n_batches * BATCH_T * N_ENVS
    load_before = os.getloadavg()
    results: dict[str, dict[str, float]] = {}
    contenders: dict[str, Callable[[AgentFactory], float]] = {
        "rlplex_parallel": lambda f: bench_rlplex("parallel", f, n_batches),
        "rlplex_serial": lambda f: bench_rlplex("serial", f, n_batches),
        "gym_async_vector_env": lambda f: bench_vec_env("gym_async", f, n_batches * BATCH_T),
        "sb3_subproc_vec_env": lambda f: bench_vec_env("sb3_subproc", f, n_batches * BATCH_T),
    }
    for agent_name, factory in AGENTS.items():
        results[agent_name] = {}
        for name, run in contenders.items():
            results[agent_name][name] = run(factory)
            print(f"  {agent_name:6s} {name:22s} {results[agent_name][name]:>10,.0f} steps/s", flush=True)
    ratios = {
        agent_name: r["rlplex_parallel"] / max(r["gym_async_vector_env"], r["sb3_subproc_vec_env"])
        for agent_name, r in results.items()
    }
    print(f"\nenv steps/s, {N_ENVS} x {ENV_ID}, {n_steps:,} steps each, {os.cpu_count()} cores")
    print(f"{'contender':24s}" + "".join(f"{a:>12s}" for a in AGENTS))
    for name in contenders:
        print(f"{name:24s}" + "".join(f"{results[a][name]:>12,.0f}" for a in AGENTS))
    print(f"{'parallel / best vec env':24s}" + "".join(f"{ratios[a]:>11.2f}x" for a in AGENTS) + "  (goal >= 1.5x)")
    out = Path("bench_results") / "sampler_throughput.json"
    out.parent.mkdir(exist_ok=True)
    payload = {
        "env": ENV_ID,
        "n_envs": N_ENVS,
        "n_workers": N_WORKERS,
        "batch_T": BATCH_T,
        "steps_per_contender": n_steps,
        "steps_per_s": results,
        "ratio_parallel_to_best_vec_env": ratios,
        "goal_ratio": 1.5,
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gymnasium": gym.__version__,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
