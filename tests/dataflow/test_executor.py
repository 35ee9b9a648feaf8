"""FunctionExecutor over in-process model workers with arithmetic interfaces.

The interfaces are deliberately trivial (this tests the executor's scheduling, sharding,
validation and release logic); tests/dataflow/test_grpo_dataflow.py runs the real model.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rlplex.dataflow import MFCDef, ModelInterfaceType, build_graph
from rlplex.dataflow.executor import FunctionExecutor, MFCExecutionError
from rlplex.dataflow.workers import LocalModelWorker, split_by_tokens
from rlplex.errors import RlplexError, WaitTimeoutError
from timing import scaled, wait_for

GEN, INF, TRAIN = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP


class Actor:
    def __init__(self) -> None:
        self.trained: list[int] = []
        self.calls = 0

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.calls += 1
        return {"seq": [np.arange(p % 5 + 1) + p for p in inputs["prompt"]]}

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for seq, reward in zip(inputs["seq"], inputs["reward"], strict=True):
            assert reward == float(seq.sum())
            self.trained.append(int(seq[0]))
        return {}


class Reward:
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"reward": [float(seq.sum()) for seq in inputs["seq"]]}


def graph(batch: int = 8) -> Any:
    return build_graph(
        [
            MFCDef("gen", "actor", GEN, ("prompt",), ("seq",), batch // 2),
            MFCDef("rew", "reward", INF, ("seq",), ("reward",), batch // 4),
            MFCDef("train", "actor", TRAIN, ("seq", "reward"), (), batch),
        ],
        dataset_keys=("prompt",),
    )


def prompts() -> Iterator[dict[str, Any]]:
    return ({"prompt": i} for i in itertools.count())


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_every_datapoint_trained_once_and_memory_flat() -> None:
    actors = [Actor(), Actor()]
    workers = {
        "actor": [LocalModelWorker(f"actor{i}", a) for i, a in enumerate(actors)],
        "reward": [LocalModelWorker("reward0", Reward())],
    }
    executor = FunctionExecutor(graph(), workers, prompts(), capacity=32)

    async def steps() -> list[dict[str, float]]:
        out = []
        for _ in range(25):
            out.append(await executor.execute_step())
            # Nothing outlives its step: metadata, ownership map and every worker store are empty.
            assert executor.buffer.size == 0 and executor.plane.n_values == 0
            assert all(len(store) == 0 for store in executor.plane.stores.values())
        return out

    metrics = run(steps())
    trained = sorted(actors[0].trained + actors[1].trained)
    assert trained == list(range(25 * 8))
    assert actors[0].calls > 0 and actors[1].calls > 0  # generation was data-parallel
    assert metrics[-1]["timings/train_run_s"] >= 0 and "timings/gen_wait_s" in metrics[-1]


def test_split_by_tokens_balances_totals() -> None:
    shards = split_by_tokens([10, 1, 1, 1, 9, 2], 2)
    totals = [sum([10, 1, 1, 1, 9, 2][p] for p in shard) for shard in shards]
    assert sorted(p for s in shards for p in s) == list(range(6)) and abs(totals[0] - totals[1]) <= 2


class Failing(Reward):
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        raise ValueError("reward model exploded")


def test_worker_exception_names_mfc_worker_and_traceback() -> None:
    workers = {"actor": [LocalModelWorker("a", Actor())], "reward": [LocalModelWorker("r", Failing())]}
    executor = FunctionExecutor(graph(), workers, prompts(), capacity=32, step_timeout=5)
    with pytest.raises(MFCExecutionError) as info:
        run(executor.execute_step())
    text = str(info.value)
    assert "MFC 'rew' failed on worker 'r'" in text and "reward model exploded" in text and "Traceback" in text
    # No half-written batch: nothing ever received the reward key.
    assert executor.buffer.ready_count("train") == 0


class MissingKey(Reward):
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"rewards": [0.0] * len(inputs["seq"])}


class WrongDtype(Reward):
    def __init__(self) -> None:
        self.calls = 0

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.calls += 1
        cast = np.float32 if self.calls == 1 else np.int64
        return {"reward": [cast(seq.sum()) for seq in inputs["seq"]]}


VIOLATIONS = [(MissingKey, "declared key 'reward'"), (WrongDtype, "key 'reward'")]


@pytest.mark.parametrize(("interface", "message"), VIOLATIONS)
def test_output_contract_violations_name_the_key(interface: type, message: str) -> None:
    workers = {"actor": [LocalModelWorker("a", Actor())], "reward": [LocalModelWorker("r", interface())]}
    executor = FunctionExecutor(graph(), workers, prompts(), capacity=32, step_timeout=5)
    with pytest.raises(MFCExecutionError, match=message):
        run(executor.execute_step())


class Hanging(Reward):
    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.release.wait(timeout=scaled(30))
        return super().inference(mfc, inputs)


def test_hung_step_dumps_blocking_keys_and_ids_within_deadline() -> None:
    release = threading.Event()
    reward = LocalModelWorker("r", Hanging(release))
    workers = {"actor": [LocalModelWorker("a", Actor())], "reward": [reward]}
    executor = FunctionExecutor(graph(), workers, prompts(), capacity=32, step_timeout=0.5)
    try:
        with pytest.raises(WaitTimeoutError) as info:
            run(executor.execute_step())
    finally:
        release.set()
        reward.close()
    assert "MFC 'train' waits for 8" in str(info.value) and "missing ['reward']" in str(info.value)


def test_unknown_model_and_indivisible_batches_refused() -> None:
    with pytest.raises(MFCExecutionError, match="no workers for models"):
        FunctionExecutor(graph(), {"actor": [LocalModelWorker("a", Actor())]}, prompts())
    bad = build_graph(
        [MFCDef("gen", "actor", GEN, ("prompt",), ("seq",), 3), MFCDef("t", "actor", TRAIN, ("seq",), (), 8)],
        ("prompt",),
    )
    with pytest.raises(MFCExecutionError, match="does not divide"):
        FunctionExecutor(bad, {"actor": [LocalModelWorker("a", Actor())]}, prompts())


# ----- issue 17: faults and asynchrony ----------------------------------------------------
class FailFirstCall(Reward):
    def __init__(self) -> None:
        self.calls = 0

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("transient reward failure")
        return super().inference(mfc, inputs)


def test_failed_step_cancels_its_mfcs_frees_its_data_and_the_next_step_runs_clean() -> None:
    actor = Actor()
    workers = {"actor": [LocalModelWorker("a", actor)], "reward": [LocalModelWorker("r", FailFirstCall())]}
    executor = FunctionExecutor(graph(), workers, prompts(), capacity=32, step_timeout=5)
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(MFCExecutionError, match="transient reward failure"):
            loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 30))
        # Every MFC loop of the failed step was cancelled and awaited: nothing is left running.
        assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
        assert executor.buffer.size == 0 and executor.plane.n_values == 0
        # A generate call the failure interrupted runs on in its thread; what it stores is dropped.
        wait_for(lambda: all(len(s) == 0 for s in executor.plane.stores.values()), 10, "stores to empty")
        loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 30))
    finally:
        loop.close()
        for group in workers.values():
            for worker in group:
                worker.close()
    assert sorted(actor.trained) == list(range(8, 16))  # step 2's batch, trained once, by step 2
    assert executor.buffer.size == 0 and all(len(s) == 0 for s in executor.plane.stores.values())


def test_exhausted_dataset_ends_the_step_at_once() -> None:
    workers = {"actor": [LocalModelWorker("a", Actor())], "reward": [LocalModelWorker("r", Reward())]}
    dataset = ({"prompt": i} for i in range(12))  # one full step of 8, then 4
    executor = FunctionExecutor(graph(), workers, dataset, capacity=32, step_timeout=600)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 30))
        with pytest.raises(RlplexError, match="exhausted: 4 datapoints left for a step of 8") as info:
            loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 10))
        assert info.typename == "DatasetExhaustedError"
        assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
        assert executor.buffer.size == 0 and executor.plane.n_values == 0
    finally:
        loop.close()


def test_empty_worker_group_refused_by_name() -> None:
    workers: dict[str, list[LocalModelWorker]] = {"actor": [LocalModelWorker("a", Actor())], "reward": []}
    with pytest.raises(MFCExecutionError, match=r"empty worker groups for models \['reward'\]"):
        FunctionExecutor(graph(), workers, prompts())


class Recorder(Actor):
    def __init__(self) -> None:
        super().__init__()
        self.generated: list[list[int]] = []

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.generated.append(sorted(inputs["prompt"]))
        return super().generate(mfc, inputs)


def test_load_data_orders_by_the_datapoints_birth_times() -> None:
    actor = Recorder()
    workers = {"actor": [LocalModelWorker("a", actor)], "reward": [LocalModelWorker("r", Reward())]}
    # Prompt i was born at 100 - i: the last to arrive is the oldest and is generated first.
    dataset = ({"prompt": i, "born": 100.0 - i} for i in itertools.count())
    executor = FunctionExecutor(graph(), workers, dataset, capacity=32, birth_key="born")
    run(executor.execute_step())
    assert actor.generated == [[4, 5, 6, 7], [0, 1, 2, 3]]
