"""The worker self-loop over DataChannels, and the seed's Source -> Tokenizer -> Sampler -> Trainer example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlplex.control import ChannelClosedError, LocalDataChannel, SelfLoopStats, run_self_loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    LocalDataChannel.cleanup(name)


def shm_pipeline_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("rlplex-ch-selfloop-*")}


def test_example_pipeline_delivers_every_item_once_in_order(tmp_path: Path) -> None:
    before = shm_pipeline_files()
    output = tmp_path / "consumed.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "examples/selfloop_pipeline.py", "--items", "15", "--sources", "3"]
    done = subprocess.run(
        [*command, "--capacity", "2", "--output", str(output)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    consumed = [tuple(pair) for pair in json.loads(output.read_text())["consumed"]]
    assert sorted(consumed) == [(src, seq) for src in range(3) for seq in range(15)]  # each exactly once
    for src in range(3):
        assert [seq for s, seq in consumed if s == src] == list(range(15)), f"source {src} out of order"
    assert "trainer consumed 45 samples" in done.stdout
    assert shm_pipeline_files() == before, "the example left shared memory behind"


def test_stage_stops_on_request_and_closes_its_sink(name: str) -> None:
    source = LocalDataChannel.create(f"{name}-in", capacity=4, slot_bytes=4096)
    sink = LocalDataChannel.create(f"{name}-out", capacity=4, slot_bytes=4096)
    stop = threading.Event()
    result: list[SelfLoopStats] = []
    worker = threading.Thread(target=lambda: result.append(run_self_loop(source, sink, lambda x: x * 2, stop)))
    worker.start()
    source.put(21)
    assert sink.get(timeout=10) == 42
    stop.set()
    worker.join(10)
    assert not worker.is_alive()
    assert result[0].reason == "stopped" and result[0].items_in == 1 and result[0].items_out == 1
    assert sink.closed and not source.closed
    with pytest.raises(ChannelClosedError):
        sink.get(timeout=1)


def test_stage_ends_when_source_drained_and_when_sink_closed(name: str) -> None:
    source = LocalDataChannel.create(f"{name}-in", capacity=8, slot_bytes=4096)
    sink = LocalDataChannel.create(f"{name}-out", capacity=8, slot_bytes=4096)
    for i in range(5):
        source.put(i)
    source.close()
    stats = run_self_loop(source, sink, lambda x: x if x % 2 == 0 else None)  # None: nothing to push
    assert (stats.reason, stats.items_in, stats.items_out) == ("drained", 5, 3)
    assert sink.get_batch(10, timeout=1) == [0, 2, 4]

    closed_downstream = LocalDataChannel.create(f"{name}-closed", capacity=2, slot_bytes=4096)
    closed_downstream.close()
    stats = run_self_loop(None, closed_downstream, lambda: iter(range(10)))
    assert stats.reason == "sink_closed" and stats.items_out == 0
