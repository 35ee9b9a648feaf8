"""LocalDataChannel across real `spawn` processes: order, backpressure, close, payloads, leaks, SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from rlplex.control import ChannelClosedError, ChannelTimeoutError, DataChannel, LocalDataChannel
from rlplex.control.channels import ring
from rlplex.control.channels.base import encode_item
from rlplex.control.channels.local import INLINE_BYTES
from timing import scaled, wait_for

CTX = mp.get_context("spawn")


def shm_files(name: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"rlplex-ch-{name}*"))


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    LocalDataChannel.cleanup(name)


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    pids = {proc.pid for proc in started}
    orphans = [child.pid for child in psutil.Process().children(recursive=True) if child.pid in pids]
    assert not orphans, f"child processes left behind: {orphans}"


def start(procs: list[Any], target: Callable[..., Any], *args: Any) -> Any:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


# ---- child processes (top level, so `spawn` can import them) --------------------------------


def echo(source_name: str, sink_name: str) -> None:
    source, sink = LocalDataChannel.attach(source_name), LocalDataChannel.attach(sink_name)
    while True:
        try:
            sink.put(source.get(timeout=30), timeout=30)
        except ChannelClosedError:
            sink.close()
            return


def produce(channel: LocalDataChannel, producer: int, count: int) -> None:
    for seq in range(count):
        payload = np.full(40_000 if seq % 7 == 0 else 8, seq, dtype=np.int64)  # some items take the large path
        channel.put({"producer": producer, "seq": seq, "payload": payload}, timeout=30)


def put_with_progress(channel: LocalDataChannel, count: int, progress: Any) -> None:
    for i in range(count):
        channel.put(i, timeout=30)
        progress.value = i + 1


def get_until_closed(channel: LocalDataChannel, results: Any) -> None:
    got = []
    try:
        while True:
            got.append(channel.get(timeout=30))
    except ChannelClosedError:
        results.put(("closed", got))
    except ChannelTimeoutError:
        results.put(("timeout", got))


def put_until_closed(channel: LocalDataChannel, results: Any) -> None:
    try:
        channel.put("blocked", timeout=30)
        results.put(("put", []))
    except ChannelClosedError:
        results.put(("closed", []))


def claim_and_hang(channel: LocalDataChannel, claimed: Any) -> None:
    # Stops between taking an item off the ring and freeing its slot, as a reader killed mid-copy.
    channel._ring.acquire()
    channel._claim(None, None)
    channel._ring.release()
    claimed.set()
    time.sleep(60)


def reserve_and_hang(channel: LocalDataChannel, reserved: Any) -> None:
    # Stops after reserving a slot and before publishing it, as a writer killed mid-copy.
    channel._ring.acquire()
    index = channel._reserve(None, None)
    channel._ring.set_slot(index, ring.WRITING, os.getpid())
    channel._ring.set(ring.TAIL, channel._ring.u64(ring.TAIL) + 1)
    channel._ring.release()
    reserved.set()
    time.sleep(60)


def consume_forever(channel: LocalDataChannel) -> None:
    while True:
        channel.get(timeout=30)


def put_all(channel: LocalDataChannel, items: list[Any]) -> None:
    for item in items:
        channel.put(item, timeout=30)


def hold_lock_at_head(channel: LocalDataChannel, holding: Any) -> None:
    # Stops inside the lock with a small item found at the head, as a getter killed while decoding it.
    channel._ring.acquire()
    channel._ready(None, None)
    holding.set()
    time.sleep(60)


def hold_lock_mid_small_put(channel: LocalDataChannel, holding: Any) -> None:
    # Stops inside the lock halfway through copying a small item into its slot, as a putter killed there.
    channel._ring.acquire()
    index, _ = channel._reserve_tail(None, None)
    channel._ring.data(index, 100)[:] = b"\xff" * 100
    holding.set()
    time.sleep(60)


def sized(total: int) -> bytes:
    """A bytes item whose encoding is exactly `total` bytes (a multiple of 64)."""
    length = total - 64
    while encode_item(b"x" * (length + 1)).size <= total:
        length += 1
    while encode_item(b"x" * length).size > total:
        length -= 1
    assert encode_item(b"x" * length).size == total
    return b"x" * length


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_items_round_trip_exactly_through_another_process(name: str, procs: list[Any]) -> None:
    out = LocalDataChannel.create(f"{name}-out", capacity=4, slot_bytes=2 << 20)
    back = LocalDataChannel.create(f"{name}-back", capacity=4, slot_bytes=2 << 20)
    start(procs, echo, out.name, back.name)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, size=1 << 20, dtype=np.uint8)  # 1 MB
    items: list[Any] = [
        {"step": 3, "ok": True, "loss": 0.25, "tags": ["a", "b"], "none": None, "raw": b"\x00\xff"},
        big,
        torch.randn(64, 33),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).T,  # non-contiguous, no numpy dtype
        {"obs": rng.standard_normal((5, 7)).astype(np.float32), "mask": np.array([True, False])},
        rng.standard_normal((700, 1000)),  # 5.6 MB: larger than a slot, goes through an overflow segment
    ]
    for item in items:
        out.put(item, timeout=10)
    out.close()
    got = [back.get(timeout=20) for _ in items]
    assert got[0] == items[0]
    assert got[1].dtype == np.uint8 and np.array_equal(got[1], big)
    assert isinstance(got[2], torch.Tensor) and torch.equal(got[2], items[2])
    assert got[3].dtype == torch.bfloat16 and torch.equal(got[3], items[3])
    assert np.array_equal(got[4]["obs"], items[4]["obs"]) and got[4]["mask"].tolist() == [True, False]
    assert np.array_equal(got[5], items[5])
    with pytest.raises(ChannelClosedError):
        back.get(timeout=10)  # echo closed its sink after draining
    assert out.stats()["lost"] == 0
    assert shm_files(name) == [f"rlplex-ch-{name}-back", f"rlplex-ch-{name}-out"]  # overflow segment gone


def test_one_handle_shared_by_threads_and_the_protocol(name: str) -> None:
    channel = LocalDataChannel.create(name, capacity=3, slot_bytes=1 << 20)
    assert isinstance(channel, DataChannel)

    def produce_in_thread(producer: int) -> None:
        for seq in range(200):
            channel.put((producer, seq, np.full(20_000 if seq % 5 == 0 else 4, seq)), timeout=30)

    threads = [threading.Thread(target=produce_in_thread, args=(p,)) for p in range(2)]
    for thread in threads:
        thread.start()
    got: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(400):
        producer, seq, data = channel.get(timeout=30)
        assert np.all(data == seq)
        got[producer].append(seq)
    for thread in threads:
        thread.join(10)
    assert got == {0: list(range(200)), 1: list(range(200))}


@pytest.mark.slow
def test_order_per_producer_with_three_producers(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=4, slot_bytes=1 << 20)
    count = 150
    for producer in range(3):
        start(procs, produce, channel, producer, count)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(3 * count):
        item = channel.get(timeout=30)
        seen[item["producer"]].append(item["seq"])
        assert int(item["payload"][0]) == item["seq"]
    assert all(seqs == list(range(count)) for seqs in seen.values()), "items out of order or missing"
    assert channel.qsize() == 0


def test_put_blocks_at_capacity_until_a_get(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=4096)
    progress = CTX.Value("i", 0)
    start(procs, put_with_progress, channel, 4, progress)
    # The third put is blocked inside the channel (a waiting putter), not merely slow.
    wait_for(lambda: progress.value == 2 and channel.stats()["waiting_putters"] == 1, 20, "producer blocked")
    assert channel.qsize() == 2
    assert channel.get(timeout=5) == 0
    wait_for(lambda: progress.value == 3, 20, "third put to complete after a get")
    assert channel.get(timeout=5) == 1
    assert channel.get(timeout=5) == 2
    wait_for(lambda: progress.value == 4, 20, "fourth put")
    channel.put(4, timeout=0)
    with pytest.raises(ChannelTimeoutError, match=name):
        channel.put(5, timeout=0)
    assert [channel.get(timeout=5), channel.get(timeout=5)] == [3, 4]


def test_put_times_out_naming_the_channel(name: str) -> None:
    channel = LocalDataChannel.create(name, capacity=1, slot_bytes=4096)
    channel.put("a")
    started = time.monotonic()
    with pytest.raises(ChannelTimeoutError, match=f"{name}.*full"):
        channel.put("b", timeout=0.2)
    assert time.monotonic() - started >= 0.2
    assert channel.get() == "a"
    with pytest.raises(ChannelTimeoutError, match=f"{name}.*empty"):
        channel.get(timeout=0.05)


def test_close_wakes_blocked_getters_and_putters_in_other_processes(name: str, procs: list[Any]) -> None:
    empty = LocalDataChannel.create(f"{name}-empty", capacity=2, slot_bytes=4096)
    full = LocalDataChannel.create(f"{name}-full", capacity=1, slot_bytes=4096)
    full.put("occupant")
    results = CTX.Queue()
    for _ in range(2):
        start(procs, get_until_closed, empty, results)
    start(procs, put_until_closed, full, results)
    wait_for(lambda: empty.stats()["waiting_getters"] == 2, 20, "two blocked getters")
    wait_for(lambda: full.stats()["waiting_putters"] == 1, 20, "one blocked putter")
    started = time.monotonic()
    empty.close()
    full.close()
    outcomes = sorted(results.get(timeout=10)[0] for _ in range(3))
    assert outcomes == ["closed", "closed", "closed"]
    assert time.monotonic() - started < 5.0, "close did not wake the waiters promptly"
    assert full.get(timeout=1) == "occupant"  # items queued before close are still delivered
    with pytest.raises(ChannelClosedError):
        full.get(timeout=1)
    with pytest.raises(ChannelClosedError):
        empty.put("late")


def test_no_shared_memory_left_after_unlink(name: str) -> None:
    with LocalDataChannel.create(name, capacity=4, slot_bytes=4096):
        other = LocalDataChannel.attach(name)
        other.put(np.zeros(100_000))  # larger than a slot: an overflow segment, left unread
        other.put({"x": 1})
        assert len(shm_files(name)) == 2
        other.detach()
    assert shm_files(name) == []
    with pytest.raises(Exception, match="does not exist"):
        LocalDataChannel.attach(name)


def test_reader_killed_mid_item_loses_only_that_item(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=4096)
    channel.put(0)
    channel.put(1)
    claimed = CTX.Event()
    victim = start(procs, claim_and_hang, channel, claimed)
    assert claimed.wait(scaled(20))  # a spawned child imports torch first: slow on a busy machine
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    channel.put(2, timeout=5)  # needs the dead reader's slot: reclaimed, not blocked forever
    assert [channel.get(timeout=5), channel.get(timeout=5)] == [1, 2]
    assert channel.stats()["lost"] == 1


def test_writer_killed_mid_item_loses_only_that_item(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=4, slot_bytes=4096)
    channel.put("before")
    reserved = CTX.Event()
    victim = start(procs, reserve_and_hang, channel, reserved)
    assert reserved.wait(scaled(20))
    channel.put("after")
    assert channel.get(timeout=5) == "before"
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    assert channel.get(timeout=5) == "after"  # the getter skipped the dead writer's slot
    assert channel.stats()["lost"] == 1


def test_consumer_sigkilled_while_streaming_leaves_the_channel_usable(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=4, slot_bytes=1 << 20)
    victim = start(procs, consume_forever, channel)
    for seq in range(4):
        channel.put({"seq": seq, "data": np.full(100_000, seq)}, timeout=10)
    wait_for(lambda: channel.stats()["head"] >= 1, 20, "victim consuming")
    os.kill(victim.pid, signal.SIGKILL)  # most likely while it copies an 800 kB item out
    victim.join(10)
    received = []
    for seq in range(4, 40):  # wraps the ring over whatever slot the victim held
        channel.put({"seq": seq, "data": np.full(100_000, seq)}, timeout=10)
        item = channel.get(timeout=10)
        assert np.all(item["data"] == item["seq"])
        received.append(item["seq"])
    received += [channel.get(timeout=10)["seq"] for _ in range(channel.qsize())]
    assert received == sorted(set(received)), "duplicates or reordering after the kill"
    assert set(range(4, 40)) <= set(received)
    assert channel.stats()["lost"] <= 1  # at most the item it was copying; what it had returned is its own


# ---- the small-item path and the waits ------------------------------------------------------


def test_items_at_the_size_boundaries_round_trip_in_order(name: str, procs: list[Any]) -> None:
    slot_bytes = 128 << 10
    # Each side of each boundary: copied under the lock / in a reserved slot / in an overflow segment.
    sizes = [64, 1024, INLINE_BYTES - 64, INLINE_BYTES, INLINE_BYTES + 64, slot_bytes - 64, slot_bytes, slot_bytes + 64]
    items = [sized(size) for size in sizes]
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=slot_bytes)
    start(procs, put_all, channel, items + items[::-1])  # capacity 2: the producer blocks and the ring wraps
    got = [channel.get(timeout=30) for _ in range(2 * len(items))]
    assert [len(item) for item in got] == [len(item) for item in items + items[::-1]]
    assert got == items + items[::-1]
    assert channel.stats()["lost"] == 0 and channel.qsize() == 0
    assert shm_files(name) == [f"rlplex-ch-{name}"]  # overflow segments removed once read


def test_small_slots_send_larger_items_to_overflow(name: str) -> None:
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=4096)  # the inline limit is the slot
    for size in (4096 - 64, 4096, 4096 + 64):
        channel.put(sized(size), timeout=5)
        assert len(shm_files(name)) == (2 if size > 4096 else 1)
        assert len(channel.get(timeout=5)) == len(sized(size))


def test_mixed_small_and_large_items_keep_their_order(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=3, slot_bytes=256 << 10)
    pattern = [8, 128, 9_000, 30_000, 8, 8, 100_000, 16]  # int64 counts: 64 B up to 800 kB (overflow)
    count = 120
    items = [{"seq": seq, "data": np.full(pattern[seq % len(pattern)], seq, dtype=np.int64)} for seq in range(count)]
    start(procs, put_all, channel, items)
    for seq in range(count):
        item = channel.get(timeout=30)
        assert item["seq"] == seq
        assert item["data"].shape == (pattern[seq % len(pattern)],) and np.all(item["data"] == seq)
    assert channel.stats()["lost"] == 0


def test_getter_killed_inside_the_lock_leaves_a_small_item_for_the_next(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=4, slot_bytes=4096)
    channel.put({"seq": 0})
    channel.put({"seq": 1})
    holding = CTX.Event()
    victim = start(procs, hold_lock_at_head, channel, holding)
    assert holding.wait(scaled(20))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    channel.put({"seq": 2}, timeout=5)  # the kernel dropped the dead getter's lock
    assert [channel.get(timeout=5)["seq"] for _ in range(3)] == [0, 1, 2]
    assert channel.stats()["lost"] == 0


def test_putter_killed_inside_the_lock_leaves_nothing_half_written(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=4096)
    channel.put("before")
    holding = CTX.Event()
    victim = start(procs, hold_lock_mid_small_put, channel, holding)
    assert holding.wait(scaled(20))
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    assert channel.qsize() == 1  # its item was never published (its put never returned)
    channel.put("after", timeout=5)  # into the slot it had half filled
    assert [channel.get(timeout=5), channel.get(timeout=5)] == ["before", "after"]
    assert channel.stats()["lost"] == 0


def test_producer_sigkilled_while_streaming_small_items_leaves_the_channel_usable(name: str, procs: list[Any]) -> None:
    channel = LocalDataChannel.create(name, capacity=4, slot_bytes=4096)
    victim = start(procs, put_all, channel, [{"seq": seq, "pad": b"x" * 900} for seq in range(100_000)])
    first = [channel.get(timeout=10)["seq"] for _ in range(50)]
    os.kill(victim.pid, signal.SIGKILL)  # most likely inside put, often inside the lock
    victim.join(10)
    rest = [channel.get(timeout=10)["seq"] for _ in range(channel.qsize())]
    received = first + rest
    assert received == list(range(len(received))), "gaps or reordering after the kill"
    for seq in range(10):  # the ring still takes and gives items
        channel.put({"seq": seq}, timeout=5)
        assert channel.get(timeout=5) == {"seq": seq}
    assert channel.stats()["lost"] <= 1


def test_waiting_counts_return_to_zero_after_wakes_and_timeouts(name: str) -> None:
    channel = LocalDataChannel.create(name, capacity=1, slot_bytes=4096)
    with pytest.raises(ChannelTimeoutError):
        channel.get(timeout=0.3)  # longer than the spin: the getter registers and sleeps
    assert channel.stats()["waiting_getters"] == 0
    got: list[Any] = []
    getter = threading.Thread(target=lambda: got.append(channel.get(timeout=30)))
    getter.start()
    wait_for(lambda: channel.stats()["waiting_getters"] == 1, 20, "a sleeping getter")
    channel.put("wake")
    getter.join(10)
    assert got == ["wake"]
    assert channel.stats()["waiting_getters"] == 0
    channel.put("full")
    putter = threading.Thread(target=channel.put, args=("second",), kwargs={"timeout": 30})
    putter.start()
    wait_for(lambda: channel.stats()["waiting_putters"] == 1, 20, "a sleeping putter")
    assert channel.get(timeout=5) == "full"
    putter.join(10)
    assert channel.get(timeout=5) == "second"
    assert channel.stats()["waiting_putters"] == 0 and channel.stats()["waiting_getters"] == 0


def fork_child_round_trip(channel: LocalDataChannel, parent_fd: int) -> None:
    # Runs in a forked child on the parent's handle: it must take its own lock (its own open file).
    item = channel.get(timeout=10)
    reopened = channel._ring._fd != parent_fd
    channel.put({"echo": item, "reopened": reopened}, timeout=10)


def test_a_forked_child_using_the_parents_handle_takes_its_own_lock(name: str) -> None:
    channel = LocalDataChannel.create(name, capacity=2, slot_bytes=4096)
    channel.put("ping")
    child = mp.get_context("fork").Process(target=fork_child_round_trip, args=(channel, channel._ring._fd))
    child.start()
    try:
        wait_for(lambda: channel.qsize() == 1 and channel.stats()["head"] == 1, 20, "the child's reply")
        assert channel.get(timeout=10) == {"echo": "ping", "reopened": True}
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
