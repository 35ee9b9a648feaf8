"""The worker self-loop of the seed: pull from a `DataChannel`, process, push to the next one.

`run_self_loop` is the whole driving pattern: a stage with a source pulls items until the
source is closed and drained (or `stop_event` is set), passes each to `process`, and pushes
what it returns to the sink (None means "nothing to push"). A stage without a source is a
producer: `process()` returns an iterable whose items are pushed. A stage without a sink is
a consumer. At the end the sink is closed, so the next stage drains and finishes too: a
pipeline shuts down front to back without any coordinator.

With several producers on one channel, close it once all of them have finished (pass
`close_sink=False` to the producers and close it from whoever waits for them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from rlplex.control.channels.base import ChannelClosedError, ChannelTimeoutError, DataChannel

__all__ = ["SelfLoopStats", "StopFlag", "run_self_loop"]


class StopFlag(Protocol):
    """`threading.Event`, `multiprocessing.Event`, or anything with `is_set()`."""

    def is_set(self) -> bool: ...


@dataclass
class SelfLoopStats:
    items_in: int = 0
    items_out: int = 0
    # Why the loop ended: "drained" (source closed and empty, or producer exhausted),
    # "stopped" (stop_event), or "sink_closed" (downstream closed its input early).
    reason: str = ""
    seconds: float = 0.0


def _push(sink: DataChannel, item: Any, stop: StopFlag | None, poll_s: float) -> bool:
    """Put with backpressure, waking every `poll_s` to honour the stop flag; False if stopped."""
    while True:
        try:
            sink.put(item, timeout=poll_s)
            return True
        except ChannelTimeoutError:
            if stop is not None and stop.is_set():
                return False


def run_self_loop(
    source: DataChannel | None,
    sink: DataChannel | None,
    process: Callable[..., Any],
    stop_event: StopFlag | None = None,
    *,
    poll_s: float = 0.1,
    close_sink: bool = True,
) -> SelfLoopStats:
    """Drive one stage until its input ends or it is stopped; returns what it did and why it ended."""
    stats = SelfLoopStats()
    started = time.monotonic()

    def stopped() -> bool:
        return stop_event is not None and stop_event.is_set()

    def emit(output: Any) -> bool:
        if output is None or sink is None:
            return True
        if not _push(sink, output, stop_event, poll_s):
            stats.reason = "stopped"
            return False
        stats.items_out += 1
        return True

    try:
        if source is None:
            outputs: Iterable[Any] = process()
            for output in outputs:
                stats.items_in += 1
                if stopped():
                    stats.reason = "stopped"
                    break
                if not emit(output):
                    break
            else:
                stats.reason = "drained"
        else:
            while not stats.reason:
                if stopped():
                    stats.reason = "stopped"
                    break
                try:
                    item = source.get(timeout=poll_s)
                except ChannelTimeoutError:
                    continue
                except ChannelClosedError:
                    stats.reason = "drained"
                    break
                stats.items_in += 1
                emit(process(item))
    except ChannelClosedError:
        stats.reason = "sink_closed"
    finally:
        if close_sink and sink is not None:
            sink.close()
        stats.seconds = time.monotonic() - started
    return stats
