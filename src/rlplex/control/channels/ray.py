"""`RayDataChannel`: a `DataChannel` whose items live in Ray's object store.

A small async actor holds a bounded deque of ObjectRefs; large payloads never pass through
it. `put` stores a large item with `ray.put` (numpy arrays are written once, zero-copy
readable by every process of the node) and hands the actor only the ref; `get` takes the
ref from the actor and reads the object. Items under `INLINE_BYTES` of arrays and bytes
ride inside the actor call instead: one round trip instead of three for small items. Torch tensors travel as numpy views
and come back as tensors (one copy on the reading side, since store objects are read-only).
Numpy arrays come back read-only, as with any `ray.get`.

Which failures lose what: Ray makes the process that calls `ray.put` the owner of the
object (Ray 2.56 removed `ray.put(_owner=...)`), so the items a producer has queued but
nobody has read yet are lost when that producer's process dies; getters skip them
(`lost` counts them) and go on with the rest. Consumers' deaths lose only what they had
taken. The death of the channel actor loses every queued item and raises `ChannelError`
in all users. Use `LocalDataChannel` where queued items must outlive their producers.
The actor is a named actor (`rlplex-ch-<name>`) owned by whoever created it, or
`detached=True` to outlive its creator (then `destroy()` it at the job's end).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from rlplex.control.channels.base import ChannelClosedError, ChannelError, ChannelTimeoutError, validate_channel_name

__all__ = ["RayDataChannel", "destroy_channels"]

ACTOR_PREFIX = "rlplex-ch-"
# A client waits on the actor's own timeout plus this much before deciding the actor is stuck.
_RPC_SLACK_S = 30.0
# Without a caller timeout the client re-asks the actor in steps this long, so no call blocks blind.
_STEP_S = 5.0
INLINE_BYTES = 64 << 10


class _TensorBox:
    """A torch tensor carried as its numpy view (zero-copy into the object store)."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: Any, dtype: str):
        self.array = array
        self.dtype = dtype


def _box(item: Any, sizes: list[int]) -> Any:
    """Tensors to `_TensorBox`es; appends the size of every array and bytes value to `sizes`."""
    if isinstance(item, dict):
        return {key: _box(value, sizes) for key, value in item.items()}
    if isinstance(item, list | tuple):
        return [_box(value, sizes) for value in item]
    if isinstance(item, bytes | np.ndarray):
        sizes.append(len(item) if isinstance(item, bytes) else item.nbytes)
    if type(item).__module__.startswith("torch") and type(item).__name__ in ("Tensor", "Parameter"):
        import torch

        tensor = item.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        sizes.append(tensor.nbytes)
        return _TensorBox(tensor.numpy(), dtype)
    return item


class _Inline:
    """A small item carried by value inside the actor's queue."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _unbox(item: Any) -> Any:
    if isinstance(item, dict):
        return {key: _unbox(value) for key, value in item.items()}
    if isinstance(item, list):
        return [_unbox(value) for value in item]
    if isinstance(item, _TensorBox):
        import torch

        return torch.from_numpy(item.array.copy()).view(getattr(torch, item.dtype))
    return item


class _ChannelActor:
    """The bounded queue of refs; answers ("ok", refs) / ("closed",) / ("timeout",) rather than raising."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque[Any] = deque()
        self.closed = False
        self.changed = asyncio.Condition()

    async def _wait(self, ready: Any, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.changed.wait_for(ready), timeout)
        except TimeoutError:
            return False
        return True

    async def put(self, boxed: list[Any], timeout: float) -> tuple[str, ...]:
        async with self.changed:
            if not await self._wait(lambda: self.closed or len(self.items) < self.capacity, timeout):
                return ("timeout",)
            if self.closed:
                return ("closed",)
            self.items.append(boxed[0])
            self.changed.notify_all()
            return ("ok",)

    async def get(self, max_items: int, timeout: float) -> tuple[Any, ...]:
        async with self.changed:
            if not await self._wait(lambda: self.closed or self.items, timeout):
                return ("timeout",)
            if not self.items:
                return ("closed",)
            refs = [self.items.popleft() for _ in range(min(max_items, len(self.items)))]
            self.changed.notify_all()
            return ("ok", refs)

    async def close(self) -> None:
        async with self.changed:
            self.closed = True
            self.changed.notify_all()

    def info(self) -> int:
        return self.capacity

    def state(self) -> tuple[int, bool]:
        return len(self.items), self.closed


class RayDataChannel:
    """A bounded FIFO between Ray tasks, actors and drivers; pass the object itself to them."""

    def __init__(self, name: str, capacity: int, actor: Any):
        # Use `create` / `attach`.
        self._name = name
        self._capacity = capacity
        self._actor = actor
        self.lost = 0  # items this handle found lost with their producer

    @classmethod
    def create(cls, name: str, capacity: int = 16, *, detached: bool = False) -> RayDataChannel:
        import ray

        validate_channel_name(name)
        if capacity < 1:
            raise ChannelError(f"channel {name!r}: capacity {capacity} must be >= 1")
        options: dict[str, Any] = {"name": ACTOR_PREFIX + name, "num_cpus": 0, "max_concurrency": 1000}
        if detached:
            options["lifetime"] = "detached"
        try:
            actor = ray.remote(_ChannelActor).options(**options).remote(capacity)
        except ValueError as error:  # the name is taken
            raise ChannelError(f"channel {name!r} cannot be created: {error}") from error
        return cls(name, capacity, actor)

    @classmethod
    def attach(cls, name: str) -> RayDataChannel:
        import ray

        try:
            actor = ray.get_actor(ACTOR_PREFIX + validate_channel_name(name))
        except ValueError as error:
            raise ChannelError(f"channel {name!r} does not exist in this Ray cluster") from error
        capacity: Any = ray.get(actor.info.remote(), timeout=_RPC_SLACK_S)
        return cls(name, int(capacity), actor)

    def destroy(self) -> None:
        """Kill the channel actor: every queued item is dropped."""
        import ray

        ray.kill(self._actor)

    def __repr__(self) -> str:
        return f"RayDataChannel({self._name!r}, capacity={self._capacity})"

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._capacity

    def _call(self, method: str, *args: Any, wait_s: float) -> Any:
        import ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=wait_s + _RPC_SLACK_S)
        except ray.exceptions.GetTimeoutError as error:
            raise ChannelError(
                f"channel {self._name!r}: actor did not answer {method} in {wait_s + _RPC_SLACK_S} s"
            ) from error
        except ray.exceptions.RayActorError as error:
            raise ChannelError(f"channel {self._name!r}: its actor died; queued items are lost") from error

    def _until(self, method: str, args: tuple[Any, ...], timeout: float | None, what: str) -> tuple[Any, ...]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _STEP_S if deadline is None else max(0.0, min(_STEP_S, deadline - time.monotonic()))
            answer: tuple[Any, ...] = self._call(method, *args, step, wait_s=step)
            if answer[0] != "timeout" or (deadline is not None and time.monotonic() >= deadline):
                break
        if answer[0] == "timeout":
            raise ChannelTimeoutError(f"channel {self._name!r}: {what} timed out after {timeout} s")
        return answer

    @property
    def closed(self) -> bool:
        return bool(self._call("state", wait_s=0)[1])

    def qsize(self) -> int:
        return int(self._call("state", wait_s=0)[0])

    def close(self) -> None:
        self._call("close", wait_s=0)

    def put(self, item: Any, timeout: float | None = None) -> None:
        import ray

        sizes: list[int] = []
        boxed = _box(item, sizes)
        # A ref goes inside a list so that Ray passes the ref itself, not its value.
        entry = _Inline(boxed) if sum(sizes) < INLINE_BYTES else ray.put(boxed)
        answer = self._until("put", ([entry],), timeout, f"put (full, {self._capacity} items)")
        if answer[0] == "closed":
            raise ChannelClosedError(f"channel {self._name!r} is closed; cannot put")

    def get_batch(self, max_items: int, timeout: float | None = None) -> list[Any]:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            answer = self._until("get", (max_items,), remaining, "get (empty)")
            if answer[0] == "closed":
                raise ChannelClosedError(f"channel {self._name!r} is closed and drained")
            items = []
            for entry in answer[1]:
                if isinstance(entry, _Inline):
                    items.append(_unbox(entry.value))
                    continue
                try:
                    items.append(_unbox(ray.get(entry, timeout=_RPC_SLACK_S)))
                except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
                    self.lost += 1  # its producer died before anyone read it
            if items:
                return items

    def get(self, timeout: float | None = None) -> Any:
        return self.get_batch(1, timeout)[0]


def destroy_channels(prefix: str) -> None:
    """Kill every channel actor whose channel name starts with `prefix` (a job's, at its end)."""
    import ray

    if not ray.is_initialized():
        return
    for name in ray.util.list_named_actors():
        if isinstance(name, str) and name.startswith(ACTOR_PREFIX + prefix):
            try:
                ray.kill(ray.get_actor(name))
            except ValueError:  # gone meanwhile
                pass
