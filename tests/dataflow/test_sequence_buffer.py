from __future__ import annotations

import asyncio
import random

import pytest

from rlplex.dataflow import BufferClosedError, MFCDef, ModelInterfaceType, SequenceBuffer
from rlplex.dataflow.buffer import BufferError_
from rlplex.errors import WaitTimeoutError

INF = ModelInterfaceType.INFERENCE
GEN = MFCDef("gen", "actor", ModelInterfaceType.GENERATE, ("prompt",), ("ids",), n_seqs=2)
REW = MFCDef("rew", "reward", INF, ("ids",), ("reward",), n_seqs=2)
TRAIN = MFCDef("train", "actor", ModelInterfaceType.TRAIN_STEP, ("ids", "reward"), (), n_seqs=4)
KEYS = ("prompt", "ids", "reward")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def make(capacity: int = 16) -> SequenceBuffer:
    return SequenceBuffer([GEN, REW, TRAIN], KEYS, capacity)


def test_readiness_requires_every_input_key() -> None:
    async def scenario() -> None:
        buf = make()
        ids = await buf.put_batch(["prompt"], [3, 4, 5, 6])
        assert buf.ready_count("gen") == 4 and buf.ready_count("rew") == 0
        buf.amend_batch(ids, ["ids"])
        assert buf.ready_count("rew") == 4 and buf.ready_count("train") == 0
        buf.amend_batch(ids[:3], ["reward"])
        assert buf.ready_count("train") == 3
        with pytest.raises(WaitTimeoutError, match="train"):
            await buf.get_batch_for_rpc(TRAIN, timeout=0.05)
        buf.amend_batch(ids[3:], ["reward"])
        batch = await buf.get_batch_for_rpc(TRAIN, timeout=1)
        assert sorted(batch.ids) == ids and sorted(batch.seqlens) == [3, 4, 5, 6]

    run(scenario())


def test_oldest_birth_time_first() -> None:
    async def scenario() -> None:
        buf = make()
        ids = await buf.put_batch(["prompt"], [1, 1, 1, 1], birth_times=[4.0, 1.0, 3.0, 2.0])
        first = await buf.get_batch_for_rpc(GEN)
        second = await buf.get_batch_for_rpc(GEN)
        assert first.ids == (ids[1], ids[3]) and second.ids == (ids[2], ids[0])

    run(scenario())


def test_freed_on_last_finish_not_on_read() -> None:
    async def scenario() -> None:
        buf = make(capacity=4)
        ids = await buf.put_batch(["prompt", "ids", "reward"], [1] * 4)
        for mfc in (GEN, REW):
            batch = await buf.get_batch_for_rpc(mfc, n=4)
            assert buf.finish(mfc, batch.ids) == []
        batch = await buf.get_batch_for_rpc(TRAIN)
        assert buf.size == 4  # read by every consumer, finished by two: still held
        assert sorted(buf.finish(TRAIN, batch.ids)) == ids and buf.size == 0
        with pytest.raises(BufferError_, match="not in the buffer"):
            buf.amend_batch(ids[:1], ["reward"])

    run(scenario())


def test_capacity_backpressure_and_release() -> None:
    async def scenario() -> None:
        buf = SequenceBuffer([GEN], KEYS, capacity=2)
        await buf.put_batch(["prompt"], [1, 1])
        blocked = asyncio.create_task(buf.put_batch(["prompt"], [1]))
        await asyncio.sleep(0)  # let the producer reach its wait
        assert not blocked.done()
        batch = await buf.get_batch_for_rpc(GEN)
        assert not blocked.done()  # reading frees nothing
        buf.finish(GEN, batch.ids)
        assert len(await asyncio.wait_for(blocked, 1)) == 1
        with pytest.raises(BufferError_, match="can never fit"):
            await buf.put_batch(["prompt"], [1, 1, 1])

    run(scenario())


def test_close_wakes_every_waiter() -> None:
    async def scenario() -> None:
        buf = SequenceBuffer([GEN, REW], KEYS, capacity=1)
        await buf.put_batch(["prompt"], [1])
        waiters = [
            asyncio.create_task(buf.get_batch_for_rpc(REW, n=1)),
            asyncio.create_task(buf.get_batch_for_rpc(GEN, n=1)),
        ]
        first = await waiters[1]  # GEN gets its one datapoint
        getter = asyncio.create_task(buf.get_batch_for_rpc(GEN, n=1))
        putter = asyncio.create_task(buf.put_batch(["prompt"], [1]))
        await asyncio.sleep(0)
        buf.close()
        for task in (waiters[0], getter, putter):
            with pytest.raises(BufferClosedError):
                await task
        assert first.ids == (0,)

    run(scenario())


def test_many_concurrent_producers_and_consumers_lose_nothing() -> None:
    async def scenario() -> None:
        buf = SequenceBuffer([GEN, REW, TRAIN], KEYS, capacity=32)
        n_items, trained = 400, []

        async def producer(k: int) -> None:
            for _ in range(n_items // 4):
                await buf.put_batch(["prompt"], [k])
                await asyncio.sleep(0)

        async def stage(mfc: MFCDef, out_key: str | None, count: int) -> None:
            for _ in range(count // mfc.n_seqs):
                batch = await buf.get_batch_for_rpc(mfc, timeout=10)
                await asyncio.sleep(random.random() * 1e-4)
                if out_key:
                    buf.amend_batch(batch.ids, [out_key])
                else:
                    trained.extend(batch.ids)
                buf.finish(mfc, batch.ids)

        await asyncio.gather(
            *(producer(k) for k in range(4)),
            stage(GEN, "ids", n_items),
            stage(REW, "reward", n_items),
            stage(TRAIN, None, n_items),
        )
        assert sorted(trained) == list(range(n_items)) and buf.size == 0

    run(scenario())


def test_dump_names_waiting_mfc_missing_keys_and_ids() -> None:
    async def scenario() -> None:
        buf = make()
        await buf.put_batch(["prompt", "ids"], [1, 1])
        with pytest.raises(WaitTimeoutError) as info:
            await buf.get_batch_for_rpc(TRAIN, timeout=0.05)
        assert "MFC 'train' waits for 4" in str(info.value) and "id 0: missing ['reward']" in str(info.value)

    run(scenario())


def test_unknown_keys_and_consumers_refused() -> None:
    async def scenario() -> None:
        buf = make()
        with pytest.raises(BufferError_, match="unknown key 'x'"):
            await buf.put_batch(["x"], [1])
        with pytest.raises(BufferError_, match="not a consumer"):
            await buf.get_batch_for_rpc("nobody")

    run(scenario())


# ----- issue 17: misuse is refused by name, with no partial effect --------------------------
def test_closed_buffer_hands_out_nothing_even_when_ready() -> None:
    async def scenario() -> None:
        buf = make()
        await buf.put_batch(["prompt"], [1, 1, 1, 1])
        buf.close()
        with pytest.raises(BufferClosedError):
            await buf.get_batch_for_rpc(GEN, timeout=1)
        with pytest.raises(BufferClosedError):
            await buf.put_batch(["prompt"], [1], timeout=1)

    run(scenario())


def test_finish_is_all_or_nothing_and_names_unknown_mfcs() -> None:
    async def scenario() -> None:
        buf = SequenceBuffer([GEN], KEYS, capacity=8)
        await buf.put_batch(["prompt"], [1, 1])
        batch = await buf.get_batch_for_rpc(GEN)
        with pytest.raises(BufferError_, match=r"never read datapoint"):
            buf.finish(GEN, [batch.ids[0], 99, batch.ids[1]])
        assert buf.size == 2  # the valid ids before the bad one were not freed
        with pytest.raises(BufferError_, match="'nobody' is not a consumer"):
            buf.finish("nobody", batch.ids)
        assert sorted(buf.finish(GEN, batch.ids)) == list(batch.ids) and buf.size == 0

    run(scenario())


def test_batch_size_below_one_refused() -> None:
    async def scenario() -> None:
        buf = make()
        await buf.put_batch(["prompt"], [1, 1, 1, 1])
        for n in (0, -1):
            with pytest.raises(BufferError_, match=f"asks for {n} datapoints"):
                await buf.get_batch_for_rpc(GEN, n=n, timeout=1)
        assert buf.ready_count("gen") == 4  # nothing was taken

    run(scenario())


def test_discard_forgets_ids_and_makes_room() -> None:
    async def scenario() -> None:
        buf = SequenceBuffer([GEN], KEYS, capacity=2)
        ids = await buf.put_batch(["prompt"], [1, 1])
        blocked = asyncio.create_task(buf.put_batch(["prompt"], [1, 1], timeout=5))
        await asyncio.sleep(0)
        assert buf.discard([ids[0], 12345]) == [ids[0]]
        assert buf.ready_count("gen") == 1 and not blocked.done()
        buf.discard(ids)
        new = await asyncio.wait_for(blocked, 5)
        assert (await buf.get_batch_for_rpc(GEN)).ids == tuple(new)

    run(scenario())
