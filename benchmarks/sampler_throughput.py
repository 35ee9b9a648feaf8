"""Env steps/s of 16 environments on this machine's cores, five ways, in one run.

    python -m benchmarks.sampler_throughput [--quick] [--env CartPole-v1 HalfCheetah-v5]
    python -m benchmarks.sampler_throughput --atari [--quick]

Two environments: CartPole-v1, whose step (a few µs) costs less than the Python around it,
and MuJoCo's HalfCheetah-v5, whose step costs about 50-150 µs, where worker processes
should pay off. For each, (a) random actions and (b) a small MLP agent (64x64; categorical
on CartPole, Gaussian on HalfCheetah) through: rlplex ParallelSampler (2 workers, inference
in the workers), rlplex SerialSampler (one process), gymnasium SyncVectorEnv (one process,
the strongest baseline when a step is cheap), gymnasium AsyncVectorEnv and stable-baselines3
SubprocVecEnv (one process per env), and on CartPole rlplex's EnvPoolSampler (`[sampler] kind =
"envpool"`, where envpool imports). Vector envs get their actions from the same agent in
the main process, one call per step over all 16 envs. Every contender runs the same number
of env steps; start-up and a warm-up are not timed.

Goals: rlplex's best sampler >= 1.0x SyncVectorEnv on CartPole and >= 1.5x it on
HalfCheetah (issue 15); ParallelSampler >= 1.5x the faster subprocess vector env (issue 2).
Writes bench_results/sampler_throughput.json.

`--atari`: 8 ALE/Pong-v5 environments with the standard preprocessing ([env.atari]: frame
skip 4, so frames/s = 4 x steps/s), random actions and the Nature-CNN agent
(CategoricalPgAgent), for the rlplex samplers, gymnasium's AsyncVectorEnv over the same
rlplex-made environments, rlplex's EnvPoolSampler, and EnvPool's own vector env (its C++ Atari
preprocessing, stepped from this process); both skipped when `envpool` does not import. The
goal (issue 15) is rlplex's Atari sampler >= 1.5x AsyncVectorEnv. Writes bench_results/sampler_throughput_atari.json.
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

from rlplex.agents import CategoricalPgAgent, GaussianPgAgent, RandomAgent
from rlplex.agents.base import Agent, AgentFactory
from rlplex.envs import AtariConfig, EnvConfig, make_env, probe_spaces
from rlplex.samplers import ParallelSampler, SerialSampler

N_ENVS = 16
N_WORKERS = 2
BATCH_T = 256
ENVS: dict[str, dict[str, AgentFactory]] = {  # env id: agent name: factory
    "CartPole-v1": {"random": RandomAgent, "mlp": partial(CategoricalPgAgent, hidden=(64, 64))},
    "HalfCheetah-v5": {"random": RandomAgent, "mlp": partial(GaussianPgAgent, hidden=(64, 64))},
}
# Batches of BATCH_T x N_ENVS steps per contender: (full, --quick).
BATCHES = {"CartPole-v1": (40, 4), "HalfCheetah-v5": (4, 1)}
GOAL_VS_SYNC = {"CartPole-v1": 1.0, "HalfCheetah-v5": 1.5}
GOAL_VS_SUBPROCESS = 1.5
ENVPOOL_TASKS = ("CartPole-v1",)  # EnvPool has no HalfCheetah-v5 (its MuJoCo tasks stop at v4)
CONTENDERS = ("rlplex_parallel", "rlplex_serial", "gym_sync_vector_env", "gym_async_vector_env", "sb3_subproc_vec_env")
ATARI = EnvConfig(id="ALE/Pong-v5", atari=AtariConfig())
ATARI_ENVS = 8
ATARI_BATCH_T = 64
ATARI_AGENTS: dict[str, AgentFactory] = {"random": RandomAgent, "cnn": CategoricalPgAgent}


def bench_rlplex(
    env: EnvConfig, kind: str, factory: AgentFactory, n_batches: int, n_envs: int = N_ENVS, batch_T: int = BATCH_T
) -> float:
    agent = factory(probe_spaces(env))
    sampler: ParallelSampler | SerialSampler
    if kind == "parallel":
        sampler = ParallelSampler(env, batch_T, n_envs, N_WORKERS, agent_factory=factory)
    elif kind == "envpool":
        from rlplex.samplers.envpool_ import EnvPoolSampler

        sampler = EnvPoolSampler(env, batch_T, n_envs)
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


def _main_process_policy(env: EnvConfig, factory: AgentFactory) -> Callable[[np.ndarray], np.ndarray]:
    spaces = probe_spaces(env)
    agent: Agent = factory(spaces)

    def observe(obs: np.ndarray) -> np.ndarray:  # images stay uint8 (the CNN scales them)
        return obs if obs.dtype == np.uint8 else np.asarray(obs, dtype=np.float32)

    if spaces.action_kind == "discrete":
        return lambda obs: agent.step(observe(obs))[0]
    low, high = np.asarray(spaces.action_low, np.float32), np.asarray(spaces.action_high, np.float32)
    # Clipped as rlplex's samplers clip what the env sees (a Gaussian policy samples unbounded).
    return lambda obs: np.clip(agent.step(observe(obs))[0], low, high)


def bench_vec_env(
    env: EnvConfig, kind: str, factory: AgentFactory, n_steps_per_env: int, n_envs: int = N_ENVS
) -> float:
    policy = _main_process_policy(env, factory)
    # Plain gym.make where rlplex adds nothing, so that the baselines are gymnasium's own.
    fns: list[Callable[[], Any]] = [
        partial(gym.make, env.id) if env.atari is None else partial(make_env, env) for _ in range(n_envs)
    ]
    if kind == "envpool":
        envs, step = _envpool(n_envs)
        obs = envs.reset()[0]
    elif kind in ("gym_sync", "gym_async"):
        envs = gym.vector.SyncVectorEnv(fns) if kind == "gym_sync" else gym.vector.AsyncVectorEnv(fns)
        obs, _ = envs.reset(seed=0)

        def step(actions: np.ndarray) -> Any:
            return envs.step(actions)[0]
    else:
        from stable_baselines3.common.vec_env import SubprocVecEnv

        envs = SubprocVecEnv(fns)
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


def bench(env_id: str, name: str, factory: AgentFactory, n_batches: int) -> float:
    env = EnvConfig(id=env_id)
    if name.startswith("rlplex_"):
        return bench_rlplex(env, name.removeprefix("rlplex_"), factory, n_batches)
    kind = {"gym_sync_vector_env": "gym_sync", "gym_async_vector_env": "gym_async"}.get(name, "sb3_subproc")
    return bench_vec_env(env, kind, factory, n_batches * BATCH_T)


def best_rlplex(rates: dict[str, float]) -> float:
    return max(rate for name, rate in rates.items() if name.startswith("rlplex_"))


def contenders_for(env_id: str) -> tuple[str, ...]:
    """Every contender; rlplex's EnvPool sampler too where EnvPool has the task (CartPole)."""
    return (*CONTENDERS, "rlplex_envpool") if env_id in ENVPOOL_TASKS and envpool_available() else CONTENDERS


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
        "rlplex_parallel": lambda f: bench_rlplex(ATARI, "parallel", f, n_batches, ATARI_ENVS, ATARI_BATCH_T),
        "rlplex_serial": lambda f: bench_rlplex(ATARI, "serial", f, n_batches, ATARI_ENVS, ATARI_BATCH_T),
        "gym_async_vector_env": lambda f: bench_vec_env(ATARI, "gym_async", f, steps_per_env, ATARI_ENVS),
    }
    if envpool_available():
        contenders["rlplex_envpool"] = lambda f: bench_rlplex(ATARI, "envpool", f, n_batches, ATARI_ENVS, ATARI_BATCH_T)
        contenders["envpool"] = lambda f: bench_vec_env(ATARI, "envpool", f, steps_per_env, ATARI_ENVS)
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
    best = {
        a: max(v for k, v in r.items() if k.startswith("rlplex_")) / r["gym_async_vector_env"]
        for a, r in results.items()
    }
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
    print(f"{'best rlplex / AsyncVectorEnv':24s}" + "".join(f"{best[a]:>11.2f}x" for a in ATARI_AGENTS))
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
        "ratio_best_rlplex_to_async_vector_env": best,
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
    parser.add_argument("--quick", action="store_true", help="a short run (4 CartPole, 1 HalfCheetah batch each)")
    parser.add_argument("--batches", type=int, default=None, help=f"batches of {BATCH_T}x{N_ENVS} steps each")
    parser.add_argument("--env", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--atari", action="store_true", help=f"{ATARI_ENVS} x preprocessed Pong instead")
    args = parser.parse_args()
    torch.set_num_threads(1)  # every contender gets one intra-op thread in its inference process
    if args.atari:
        atari_main(args.quick, args.batches)
        return
    load_before = os.getloadavg()
    results: dict[str, dict[str, dict[str, float]]] = {}  # env: agent: contender: steps/s
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    steps: dict[str, int] = {}
    for env_id in args.env:
        n_batches = args.batches or BATCHES[env_id][1 if args.quick else 0]
        steps[env_id] = n_batches * BATCH_T * N_ENVS
        results[env_id], ratios[env_id] = {}, {}
        for agent_name, factory in ENVS[env_id].items():
            r = results[env_id][agent_name] = {}
            for name in contenders_for(env_id):
                r[name] = bench(env_id, name, factory, n_batches)
                print(f"  {env_id:15s} {agent_name:6s} {name:22s} {r[name]:>10,.0f} steps/s", flush=True)
            ratios[env_id][agent_name] = {
                "best_rlplex_to_gym_sync": best_rlplex(r) / r["gym_sync_vector_env"],
                "parallel_to_best_subprocess": r["rlplex_parallel"]
                / max(r["gym_async_vector_env"], r["sb3_subproc_vec_env"]),
            }
    for env_id in args.env:
        agents = list(ENVS[env_id])
        print(f"\nenv steps/s, {N_ENVS} x {env_id}, {steps[env_id]:,} steps each, {os.cpu_count()} cores")
        print(f"{'contender':30s}" + "".join(f"{a:>12s}" for a in agents))
        for name in contenders_for(env_id):
            print(f"{name:30s}" + "".join(f"{results[env_id][a][name]:>12,.0f}" for a in agents))
        for key, label, goal in (
            ("best_rlplex_to_gym_sync", "best rlplex / gym sync", GOAL_VS_SYNC[env_id]),
            ("parallel_to_best_subprocess", "parallel / best subprocess", GOAL_VS_SUBPROCESS),
        ):
            print(
                f"{label:30s}" + "".join(f"{ratios[env_id][a][key]:>11.2f}x" for a in agents) + f"  (goal >= {goal}x)"
            )
    out = Path("bench_results") / "sampler_throughput.json"
    out.parent.mkdir(exist_ok=True)
    payload = {
        "envs": args.env,
        "n_envs": N_ENVS,
        "n_workers": N_WORKERS,
        "batch_T": BATCH_T,
        "steps_per_contender": steps,
        "steps_per_s": results,
        "ratios": ratios,
        "goal_best_rlplex_to_gym_sync": GOAL_VS_SYNC,
        "goal_parallel_to_best_subprocess": GOAL_VS_SUBPROCESS,
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
