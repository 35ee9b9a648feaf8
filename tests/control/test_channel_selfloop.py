"""The worker self-loop over DataChannels, and the seed's Source -> Tokenizer -> Sampler -> Trainer job."""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_helpers import node_processes, wait_for
from rlplex.control import (
    ChannelClosedError,
    JobBuilder,
    JobSpec,
    JobState,
    LocalDataChannel,
    PrimeMaster,
    SelfLoopStats,
    load_job,
    parse_job,
    run_self_loop,
)
from timing import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    LocalDataChannel.cleanup(name)


def selfloop_job(out: Path, items: int, sources: int, delay_s: float = 0.0) -> JobSpec:
    """examples/selfloop_job.toml in `out`, with this many documents, channels of 2 items."""
    data = load_job(ROOT / "examples" / "selfloop_job.toml").model_dump(mode="json")
    data["output_dir"] = str(out)
    data["roles"]["source"]["config"]["settings"] = {"items": items, "sources": sources}
    data["roles"]["tokenizer"]["config"]["settings"] = {"delay_s": delay_s}
    for role in data["roles"].values():
        role["config"]["capacity"] = 2
    return parse_job(data, source="a test")


def consumed(out: Path) -> list[tuple[int, int]]:
    path = out / "consumed.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(row["source"], row["seq"]) for row in map(json.loads, lines)]


@pytest.fixture
def at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the nodes import the stages as examples.selfloop_pipeline


@pytest.mark.usefixtures("at_the_root")
def test_the_example_job_delivers_every_item_once_in_order_and_removes_its_channels(job_dir: Path) -> None:
    with PrimeMaster.create(selfloop_job(job_dir, items=15, sources=3)) as master:
        master.start()
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED, master.cause
        assert master.cause == "every node finished"
    items = consumed(job_dir)
    assert sorted(items) == [(src, seq) for src in range(3) for seq in range(15)]  # each exactly once
    for src in range(3):
        assert [seq for s, seq in items if s == src] == list(range(15)), f"source {src} out of order"
    assert sorted(Path("/dev/shm").glob(f"rlplex-ch-{master.job_id}*")) == []


@pytest.mark.usefixtures("at_the_root")
def test_a_stage_killed_mid_stream_is_restarted_and_the_pipeline_goes_on(job_dir: Path) -> None:
    """SIGKILL the tokenizer's node while items flow: the job restarts it, it attaches to the
    channels again, and the pipeline ends with no item twice or out of order, and at most the
    one item the killed node held lost."""
    with PrimeMaster.create(selfloop_job(job_dir, items=60, sources=2, delay_s=0.02)) as master:
        master.start()
        wait_for(lambda: len(consumed(job_dir)) >= 10, 60, "ten items through the pipeline")
        (tokenizer,) = [p for p in node_processes(job_dir) if "tokenizer-0" in p.cmdline()]
        tokenizer.send_signal(signal.SIGKILL)
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED, master.cause
        restarts = {node.node_id: node.incarnation for node in master.store.nodes(master.job_id)}
    assert restarts["tokenizer-0"] == 1, restarts
    items = consumed(job_dir)
    assert len(items) == len(set(items)) >= 119, items  # of 120: none twice, at most one lost
    for src in range(2):
        seqs = [seq for s, seq in items if s == src]
        assert seqs == sorted(seqs), f"source {src} out of order: {seqs}"


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


def test_a_stage_of_several_nodes_shares_its_channels_and_closes_its_sink_once_all_drained(job_dir: Path) -> None:
    """Two doubler nodes pull from one channel: every item is doubled exactly once, and the
    collector ends only when both have drained (the sink is closed by the last of them)."""
    spec = (
        JobBuilder("pair", job_dir, capacity={"cpu": 2}, heartbeat_interval_s=0.2)
        .role("produce", entrypoint="rlplex.control:SelfLoopWorker", resources={"cpu": 0.2},
              config={"stage": "control_workers:numbers", "sink": "n", "capacity": 2, "settings": {"items": 200}})
        .role("double", entrypoint="rlplex.control:SelfLoopWorker", count=2, resources={"cpu": 0.2},
              config={"stage": "control_workers:doubled", "source": "n", "sink": "d", "capacity": 2})
        .role("collect", entrypoint="rlplex.control:SelfLoopWorker", resources={"cpu": 0.2},
              config={"stage": "control_workers:collected", "source": "d", "capacity": 2})
        .build()
    )  # fmt: skip
    with PrimeMaster.create(spec) as master:
        master.start()
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED, master.cause
        assert master.cause == "every node finished"
    got = [int(line) for line in (job_dir / "collected.txt").read_text().split()]
    assert sorted(got) == [2 * i for i in range(200)]
    logs = [(job_dir / "logs" / f"double-{rank}.log").read_text() for rank in range(2)]
    assert all("ended: drained" in log for log in logs), logs
