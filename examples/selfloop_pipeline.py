"""The seed's worker self-loop pipeline: Source -> Tokenizer -> Sampler -> Trainer.

Four OS processes joined by three `LocalDataChannel`s; each stage is `run_self_loop`
(pull, process, push, until its source is closed and drained). The source closes its sink
when it runs out, and the close travels down the pipeline, so every stage ends by itself.

    python examples/selfloop_pipeline.py --items 12 [--output consumed.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from rlplex.control import LocalDataChannel, run_self_loop

VOCAB = 1000
WORDS = ["the", "cart", "pole", "falls", "left", "right", "agent", "learns", "slowly", "again"]


def source(items: int, sources: int) -> Iterator[dict[str, Any]]:
    """Text documents from `sources` interleaved streams, each tagged (source, seq)."""
    for seq in range(items):
        for src in range(sources):
            words = [WORDS[(seq * 3 + src + k) % len(WORDS)] for k in range(3 + seq % 5)]
            yield {"source": src, "seq": seq, "text": " ".join(words)}


def tokenize(doc: dict[str, Any]) -> dict[str, Any]:
    ids = np.array([zlib.crc32(word.encode()) % VOCAB for word in doc["text"].split()], dtype=np.int32)
    return {"source": doc["source"], "seq": doc["seq"], "tokens": ids}


def sample(doc: dict[str, Any]) -> dict[str, Any]:
    """A training sample: tokens padded to 8, with a mask and next-token targets."""
    tokens = doc["tokens"][:8]
    input_ids = np.zeros(8, dtype=np.int32)
    input_ids[: len(tokens)] = tokens
    mask = np.zeros(8, dtype=bool)
    mask[: len(tokens)] = True
    return {"source": doc["source"], "seq": doc["seq"], "input_ids": input_ids, "mask": mask}


def stage(name: str, source_name: str | None, sink_name: str | None, items: int, sources: int, log: str) -> None:
    """One worker process: attach its channels by name and self-loop."""
    src = LocalDataChannel.attach(source_name, timeout=10) if source_name else None
    sink = LocalDataChannel.attach(sink_name, timeout=10) if sink_name else None
    consumed: list[list[int]] = []
    tokens = 0

    def train(batch: dict[str, Any]) -> None:
        nonlocal tokens
        consumed.append([batch["source"], batch["seq"]])
        tokens += int(batch["mask"].sum())

    if name == "source":
        stats = run_self_loop(None, sink, lambda: source(items, sources))
    elif name == "tokenizer":
        stats = run_self_loop(src, sink, tokenize)
    elif name == "sampler":
        stats = run_self_loop(src, sink, sample)
    else:
        stats = run_self_loop(src, None, train)
        with open(log, "w") as file:
            json.dump({"consumed": consumed, "tokens": tokens}, file)
    print(f"{name:>9}: in {stats.items_in:4d}  out {stats.items_out:4d}  ended: {stats.reason}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=12, help="documents per source stream")
    parser.add_argument("--sources", type=int, default=2, help="interleaved source streams")
    parser.add_argument("--capacity", type=int, default=4, help="items each channel holds before backpressure")
    parser.add_argument("--output", default="", help="write what the trainer consumed to this JSON file")
    args = parser.parse_args(argv)

    job = f"selfloop-{os.getpid()}"
    names = [f"{job}-docs", f"{job}-tokens", f"{job}-samples"]
    channels = [LocalDataChannel.create(n, capacity=args.capacity, slot_bytes=64 << 10) for n in names]
    log = args.output or f"/tmp/{job}-consumed.json"
    wiring = [("source", None, names[0]), ("tokenizer", names[0], names[1]), ("sampler", names[1], names[2])]
    wiring.append(("trainer", names[2], None))
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=stage, args=(stage_name, src, dst, args.items, args.sources, log), name=stage_name)
        for stage_name, src, dst in wiring
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
            if proc.exitcode != 0:
                print(f"stage {proc.name} failed (exit code {proc.exitcode})", file=sys.stderr)
                return 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for channel in channels:
            channel.unlink()
            channel.detach()
    with open(log) as file:
        result = json.load(file)
    print(f"trainer consumed {len(result['consumed'])} samples, {result['tokens']} tokens:")
    for src in range(args.sources):
        print(f"  source {src}: seq {[seq for s, seq in result['consumed'] if s == src]}")
    if not args.output:
        os.unlink(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
