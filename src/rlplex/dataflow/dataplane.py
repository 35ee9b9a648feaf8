"""Where the tensors of a step live: in the stores of the workers that produced them.

The master never holds tensors. It knows, per datapoint and key, which store owns the value
(`owner`), and how many consumer MFCs still need each datapoint. A worker that lacks an
input fetches it from the owning store. When a datapoint's last consumer finishes, every
value of it is dropped from every store (reference counting, idempotent), so memory stays
flat over a long run (AReaL leaked ~2 GB a step by keeping tensors apart from metadata).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from rlplex.errors import RlplexError


class DataPlaneError(RlplexError):
    """A value was asked for that no store holds."""


class TensorStore(Protocol):
    """One worker's values, keyed by (datapoint id, key). A process-backed worker serves this over RPC."""

    name: str

    def get_many(self, ids: Sequence[int], key: str) -> list[Any]: ...

    def put_many(self, ids: Sequence[int], key: str, values: Sequence[Any]) -> None: ...

    def drop(self, ids: Iterable[int]) -> None: ...

    def __len__(self) -> int: ...


class LocalTensorStore:
    def __init__(self, name: str) -> None:
        self.name = name
        self._values: dict[int, dict[str, Any]] = {}

    def get_many(self, ids: Sequence[int], key: str) -> list[Any]:
        try:
            return [self._values[i][key] for i in ids]
        except KeyError as error:
            raise DataPlaneError(f"store {self.name!r} has no value {key!r} for datapoint {error.args[0]}") from None

    def put_many(self, ids: Sequence[int], key: str, values: Sequence[Any]) -> None:
        for i, value in zip(ids, values, strict=True):
            self._values.setdefault(i, {})[key] = value

    def drop(self, ids: Iterable[int]) -> None:
        for i in ids:
            self._values.pop(i, None)

    def __len__(self) -> int:
        return len(self._values)


class DataPlane:
    """The master's map of which store owns which (datapoint, key)."""

    def __init__(self, stores: Sequence[TensorStore]) -> None:
        self.stores = {store.name: store for store in stores}
        self._owner: dict[tuple[int, str], str] = {}

    def record(self, store: str, ids: Sequence[int], keys: Sequence[str]) -> None:
        for i in ids:
            for key in keys:
                self._owner[(i, key)] = store

    def locate(self, ids: Sequence[int], key: str) -> dict[str, list[int]]:
        """Which store owns `key` for each of `ids`, grouped by store."""
        by_store: dict[str, list[int]] = {}
        for i in ids:
            try:
                by_store.setdefault(self._owner[(i, key)], []).append(i)
            except KeyError:
                raise DataPlaneError(f"no store holds key {key!r} of datapoint {i}") from None
        return by_store

    def gather(self, ids: Sequence[int], key: str) -> list[Any]:
        """Values of `key` for `ids`, fetched from whichever stores own them, in order."""
        by_store = self.locate(ids, key)
        fetched: dict[int, Any] = {}
        for store, store_ids in by_store.items():
            fetched.update(zip(store_ids, self.stores[store].get_many(store_ids, key), strict=True))
        return [fetched[i] for i in ids]

    def release(self, ids: Sequence[int]) -> None:
        """Drop every value of `ids` from every store (safe to call twice)."""
        id_set = set(ids)
        for key in [k for k in self._owner if k[0] in id_set]:
            del self._owner[key]
        for store in self.stores.values():
            store.drop(ids)

    @property
    def n_values(self) -> int:
        return len(self._owner)
