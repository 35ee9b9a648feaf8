"""RayDataChannel on a real local Ray (num_cpus=2): payloads, order, backpressure, close."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_helpers import wait_for
from rlplex.control import ChannelClosedError, ChannelTimeoutError, DataChannel, RayDataChannel

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_address")]

ray = pytest.importorskip("ray")
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def channel_name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@ray.remote
def produce(channel: RayDataChannel, producer: int, count: int) -> int:
    for seq in range(count):
        channel.put({"producer": producer, "seq": seq}, timeout=30)
    return count


@ray.remote
def get_until_closed(channel: RayDataChannel) -> str:
    try:
        while True:
            channel.get(timeout=30)
    except ChannelClosedError:
        return "closed"


@ray.remote
def put_blocked(channel: RayDataChannel) -> str:
    try:
        channel.put("blocked", timeout=30)
        return "put"
    except ChannelClosedError:
        return "closed"


def test_numpy_and_tensors_round_trip_exactly(channel_name: str) -> None:
    channel = RayDataChannel.create(channel_name, capacity=4)
    assert isinstance(channel, DataChannel)
    big = np.random.default_rng(0).integers(0, 255, size=1 << 20, dtype=np.uint8)
    tensor = torch.randn(16, 9)
    channel.put({"big": big, "t": tensor, "half": tensor.to(torch.bfloat16), "meta": [1, "x", None]})
    got = channel.get(timeout=30)
    assert np.array_equal(got["big"], big)
    assert torch.equal(got["t"], tensor) and torch.equal(got["half"], tensor.to(torch.bfloat16))
    assert got["meta"] == [1, "x", None]
    channel.destroy()


def test_order_per_producer_across_tasks(channel_name: str) -> None:
    channel = RayDataChannel.create(channel_name, capacity=3)
    refs = [produce.remote(channel, producer, 40) for producer in range(3)]
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(120):
        item = channel.get(timeout=30)
        seen[item["producer"]].append(item["seq"])
    assert ray.get(refs, timeout=30) == [40, 40, 40]
    assert all(seqs == list(range(40)) for seqs in seen.values())
    channel.destroy()


def test_backpressure_and_timeout(channel_name: str) -> None:
    channel = RayDataChannel.create(channel_name, capacity=2)
    ref = produce.remote(channel, 0, 3)
    wait_for(lambda: channel.qsize() == 2, 30, "channel full")
    ready, _ = ray.wait([ref], timeout=0.5)
    assert not ready, "the third put should block while the channel is full"
    assert channel.get(timeout=10)["seq"] == 0
    assert ray.get(ref, timeout=30) == 3
    assert channel.qsize() == 2
    with pytest.raises(ChannelTimeoutError, match=channel_name):
        channel.put("x", timeout=0.2)
    channel.destroy()


def test_close_wakes_getters_and_putters(channel_name: str) -> None:
    empty = RayDataChannel.create(channel_name + "-e", capacity=2)
    full = RayDataChannel.create(channel_name + "-f", capacity=1)
    full.put("occupant")
    refs = [get_until_closed.remote(empty), put_blocked.remote(full)]
    ready, _ = ray.wait(refs, timeout=1.0)
    assert not ready, "both should block before close"
    empty.close()
    full.close()
    assert ray.get(refs, timeout=10) == ["closed", "closed"]
    assert full.get(timeout=5) == "occupant"
    with pytest.raises(ChannelClosedError):
        full.get(timeout=5)
    attached: Any = RayDataChannel.attach(channel_name + "-e")
    assert attached.closed and attached.capacity == 2
    empty.destroy()
    full.destroy()
