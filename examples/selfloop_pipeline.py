"""The stages of seed 003's worker self-loop pipeline: Source -> Tokenizer -> Sampler -> Trainer.

Run them as a control-plane job: `rlplex job run examples/selfloop_job.toml` (from the
repository's root, where `examples.selfloop_pipeline` imports). Each role is a
`SelfLoopWorker` that pulls from one job channel, calls its stage and pushes to the next;
the end of the input travels down the channels and the job ends by itself. Kill a stage's node
(`rlplex job status outputs/selfloop_job` lists their pids): the job restarts it and it goes on
with what its channel holds.

Each function here takes the node's `WorkerContext` and returns the stage's `process`.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rlplex.control import WorkerContext

VOCAB = 1000
WORDS = ["the", "cart", "pole", "falls", "left", "right", "agent", "learns", "slowly", "again"]


def documents(items: int, sources: int) -> Iterator[dict[str, Any]]:
    """Text documents from `sources` interleaved streams, each tagged (source, seq)."""
    for seq in range(items):
        for src in range(sources):
            words = [WORDS[(seq * 3 + src + k) % len(WORDS)] for k in range(3 + seq % 5)]
            yield {"source": src, "seq": seq, "text": " ".join(words)}


def source(context: WorkerContext) -> Callable[[], Iterator[dict[str, Any]]]:
    """The documents, from where a restarted source left off: its cursor (in the job's folder)
    moves on only once the stage has pushed the document, so a restart repeats at most one."""
    settings = context.config["settings"]
    cursor = Path(context.output_dir) / "selfloop" / context.job_id / "source.cursor"

    def produce() -> Iterator[dict[str, Any]]:
        cursor.parent.mkdir(parents=True, exist_ok=True)
        start = int(cursor.read_text()) if cursor.exists() else 0
        for index, doc in enumerate(documents(settings["items"], settings["sources"])):
            if index >= start:
                yield doc
                cursor.write_text(str(index + 1))  # reached when the next document is asked for

    return produce


def tokenizer(context: WorkerContext) -> Callable[[dict[str, Any]], dict[str, Any]]:
    delay_s = float(context.config["settings"].get("delay_s", 0.0))

    def tokenize(doc: dict[str, Any]) -> dict[str, Any]:
        time.sleep(delay_s)  # stands for real work: lets a demo kill the node mid-stream
        ids = np.array([zlib.crc32(word.encode()) % VOCAB for word in doc["text"].split()], dtype=np.int32)
        return {"source": doc["source"], "seq": doc["seq"], "tokens": ids}

    return tokenize


def sampler(context: WorkerContext) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def sample(doc: dict[str, Any]) -> dict[str, Any]:
        """A training sample: tokens padded to 8, with a mask."""
        tokens = doc["tokens"][:8]
        input_ids = np.zeros(8, dtype=np.int32)
        input_ids[: len(tokens)] = tokens
        mask = np.zeros(8, dtype=bool)
        mask[: len(tokens)] = True
        return {"source": doc["source"], "seq": doc["seq"], "input_ids": input_ids, "mask": mask}

    return sample


def trainer(context: WorkerContext) -> Callable[[dict[str, Any]], None]:
    """Consumes samples; appends each one's (source, seq, tokens) to `consumed.jsonl` in the job's folder."""
    log = Path(context.output_dir) / "consumed.jsonl"

    def train(batch: dict[str, Any]) -> None:
        row = {"source": batch["source"], "seq": batch["seq"], "tokens": int(batch["mask"].sum())}
        with log.open("a") as file:
            file.write(json.dumps(row) + "\n")

    return train
