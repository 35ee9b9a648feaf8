"""How long the tiny checkpoint takes to build and to load, the Hugging Face way.

    python -m benchmarks.model_loading [--quick] [--repeats 5]

Build: `build_tiny_model` into a fresh folder with `rlplex model tiny`'s default settings (BPE
tokenizer trained on the spot, Qwen2 model, supervised warm-up, `save_pretrained`), then the
same call again (the cache answers). Load: `load_tokenizer` + `load_causal_lm` (what every
trainer rank and orchestrator does at start), the median of `--repeats` in fresh processes,
torch and transformers already imported (their import is not the model's load).

Goals (issue 12): build under 60 s, load under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from rlplex.models.tiny import TinyModelConfig, build_tiny_model

NAME = "model_loading"
LOAD = """
import sys, time
import torch
import transformers
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.spec import ModelSpec
spec = ModelSpec(name=sys.argv[1], device="cpu")
t0 = time.perf_counter()
load_tokenizer(spec)
load_causal_lm(spec)
print(time.perf_counter() - t0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 10-step warm-up, 2 loads")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = TinyModelConfig(warmup_steps=10) if args.quick else TinyModelConfig()
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="rlplex-model-bench-") as tmp:
        out = Path(tmp) / "tiny"
        t0 = time.perf_counter()
        build_tiny_model(out, config)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_tiny_model(out, config)
        cached_s = time.perf_counter() - t0
        loads = [
            float(subprocess.run([sys.executable, "-c", LOAD, str(out)], capture_output=True, text=True, check=True)
                  .stdout.strip().splitlines()[-1])
            for _ in range(repeats)
        ]  # fmt: skip
        size_mb = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    load_s = statistics.median(loads)
    rows = [
        ("build (fresh)", build_s, 60.0, build_s < 60.0),
        ("build (cached)", cached_s, "-", "-"),
        (f"load, median of {repeats}", load_s, 2.0, load_s < 2.0),
    ]
    report(
        NAME,
        f"tiny checkpoint ({config.warmup_steps} warm-up steps, {size_mb:.1f} MB): seconds",
        ["what", "seconds", "goal", "met"],
        rows,
        {
            "config": config.model_dump(mode="json"),
            "build_s": build_s,
            "cached_s": cached_s,
            "loads_s": loads,
            "load_s": load_s,
            "size_mb": size_mb,
        },
    )


if __name__ == "__main__":
    main()
