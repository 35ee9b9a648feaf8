"""`SelfLoopWorker`: the seed's worker self-loop as a role of a control-plane job.

A job wires stages with `DataChannel`s by name: each role's config names the function that
makes its stage's `process` (`stage = "module:function"`, called with the node's
`WorkerContext`), the channel it pulls from (`source`) and the one it pushes to (`sink`), and
every node of the role runs `run_self_loop` on them. Seed 003's pipeline is four such roles
(`examples/selfloop_job.toml`):

    source --docs--> tokenizer --tokens--> sampler --samples--> trainer

The channels belong to the job, not to a node (`WorkerContext.channel_name`): the first node
that opens one creates it, the others attach, and the job's end removes them. On the local
backend they are `LocalDataChannel`s in shared memory, whose queued items outlive any node,
so a stage that the failure policy restarts attaches again and goes on with what is queued;
on Ray they are `RayDataChannel`s, detached actors destroyed at the job's end.

A role ends its sink when all its nodes have drained their source (each leaves a marker in
`<output>/selfloop/<job id>/`, and the one that finds every marker there closes the sink), so the end
of the input travels down the pipeline and every role finishes by itself.

Delivery: a stage killed while it holds an item loses that item (the channel has no
acknowledgements); a restarted producer runs its `process()` again, so a producer that must
not repeat itself keeps its own cursor (the example's source does, in the job's folder).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.control.channels.base import ChannelError, DataChannel
from rlplex.control.channels.selfloop import run_self_loop
from rlplex.control.node.worker import WorkerContext, WorkerLoad, import_target, job_channel_prefix

log = logging.getLogger(__name__)

MARKERS = "selfloop"  # the folder of the roles' "drained" markers, in the job's output folder


class SelfLoopConfig(StrictModel):
    """`[roles.<stage>.config]` of a `SelfLoopWorker`."""

    stage: str = Field(
        pattern=r"^[\w.]+:[\w.]+$",
        description="'module:function' taking the WorkerContext and returning the stage's process: a "
        "producer's (no source) takes no argument and returns an iterable of items, the others take one item "
        "and return the item to push (None: nothing)",
    )
    source: str | None = Field(None, description="the channel this stage pulls from (none: a producer)")
    sink: str | None = Field(None, description="the channel this stage pushes to (none: a consumer)")
    capacity: int = Field(16, ge=1, description="items a channel holds before a producer waits (its creator's)")
    slot_bytes: int = Field(64 << 10, ge=256, description="bytes of one item kept inline (shared memory)")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="the stage's own settings, read by its function from context.config"
    )


def open_job_channel(context: WorkerContext, name: str, capacity: int, slot_bytes: int) -> DataChannel:
    """The job's channel `name`: created by the first node that opens it, attached by the others;
    in Ray's object store when the job runs on Ray, else in this machine's shared memory."""
    full = context.channel_name(name)
    if context.backend == "ray":
        from rlplex.control.channels.ray import RayDataChannel

        try:
            return RayDataChannel.create(full, capacity, detached=True)  # the job's end destroys it
        except ChannelError:
            return RayDataChannel.attach(full)
    from rlplex.control.channels.local import LocalDataChannel

    return LocalDataChannel.create(full, capacity, slot_bytes, exist_ok=True)


def remove_job_channels(job_id: str, on_ray: bool) -> None:
    """At the job's end: its channels on this machine and, on Ray, its channel actors."""
    from rlplex.control.channels.local import LocalDataChannel

    prefix = job_channel_prefix(job_id)
    try:
        LocalDataChannel.cleanup(prefix=prefix)
    except OSError as error:
        log.warning("job %s: could not remove its channels: %s", job_id, error)
    if on_ray:
        from rlplex.control.channels.ray import destroy_channels

        destroy_channels(prefix)


class SelfLoopWorker(WorkerLoad):
    config_model = SelfLoopConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.config = SelfLoopConfig.model_validate(context.config)

    def self_check(self) -> None:
        make = import_target(self.config.stage)  # a wrong name fails the node's check, naming it
        if not callable(make):
            raise ChannelError(f"stage '{self.config.stage}' of role {self.context.role} is not callable")

    def run(self) -> None:
        cfg, context = self.config, self.context
        process = import_target(cfg.stage)(context)
        source = open_job_channel(context, cfg.source, cfg.capacity, cfg.slot_bytes) if cfg.source else None
        sink = open_job_channel(context, cfg.sink, cfg.capacity, cfg.slot_bytes) if cfg.sink else None
        counted = self._counted(process, producer=source is None)
        stats = run_self_loop(source, sink, counted, context.stop_event, close_sink=False)
        print(f"{context.node_id}: in {stats.items_in} out {stats.items_out}, ended: {stats.reason}", flush=True)
        if stats.reason == "drained" and sink is not None and self._last_to_drain():
            sink.close()  # the end of the input goes on downstream

    def _counted(self, process: Callable[..., Any], producer: bool) -> Callable[..., Any]:
        """`process`, reporting the items it has seen (the role's progress deadline watches them)."""
        seen = 0

        def count() -> None:
            nonlocal seen
            seen += 1
            self.context.report_progress(items=seen)

        if producer:

            def produce() -> Iterable[Any]:
                for item in process():
                    count()
                    yield item

            return produce

        def each(item: Any) -> Any:
            count()
            return process(item)

        return each

    def _last_to_drain(self) -> bool:
        """Mark this node drained; True when every node of the role has."""
        folder = Path(self.context.output_dir) / MARKERS / self.context.job_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{self.context.node_id}.drained").touch()
        count = self.context.world.get(self.context.role, 1)
        return all((folder / f"{self.context.role}-{rank}.drained").exists() for rank in range(count))
