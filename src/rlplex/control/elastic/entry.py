"""A function entry point as an `ElasticWorker`'s script: `python -m rlplex.control.elastic.entry MODULE:FUNCTION`.

The worker writes the role's `config.config` on the script's stdin as JSON; this process rebuilds
it as the function's config model (the annotation of its one parameter, e.g.
`def run_trainer(config: TrainerConfig)`), joins the torch.distributed group the ElasticWorker
formed for this round (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the
worker's agent store), calls the function and leaves the group. So a config crosses into the
script once, as the JSON of its model, and is validated on both sides of that boundary: by the
job's check when the job file is loaded (`config_model_of`), and here.

A graceful stop is SIGTERM or SIGINT (the ElasticWorker's `request_stop`, or its node's stop),
or `RLPLEX_STOP_REQUESTED=1` in the environment (a script started after a stop was asked). It
only sets `stop_event()`: the function polls it and ends its work cleanly. The handlers are
installed before anything slow is imported, so a stop asked during start-up is not lost.

Exit codes: the function's int result (0 for None); 2 when the config does not fit the model.
Torch is imported only to join a group of more than one rank.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

from rlplex.errors import JobSpecError

STOP_ENV = "RLPLEX_STOP_REQUESTED"
EXIT_BAD_CONFIG = 2
_STOP = threading.Event()


def stop_event() -> threading.Event:
    """Set once this process is asked to stop gracefully (see `install_stop_handlers`)."""
    return _STOP


def install_stop_handlers() -> threading.Event:
    """SIGTERM and SIGINT set `stop_event()` instead of killing the process (main thread only)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        print(f"signal {signum}: stopping gracefully", file=sys.stderr, flush=True)
        _STOP.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    if os.environ.get(STOP_ENV) == "1":
        _STOP.set()
    return _STOP


def config_model_of(function: Callable[..., Any], target: str) -> Any:
    """The pydantic model a function entry point takes: the annotation of its one parameter."""
    from pydantic import BaseModel

    parameters = list(inspect.signature(function).parameters)
    hints = typing.get_type_hints(function) if parameters else {}
    model = hints.get(parameters[0]) if parameters else None
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise JobSpecError(f"'{target}' must take one parameter annotated with its pydantic config model")
    return model


def load_function(target: str) -> tuple[Callable[..., Any], Any]:
    """The function named 'module:function' and its config model."""
    from rlplex.control.node.worker import import_target

    function = import_target(target)
    if inspect.isclass(function) or not callable(function):
        raise JobSpecError(f"'{target}' is not a function")
    return function, config_model_of(function, target)


def join_group(backend: str = "gloo", timeout_s: float | None = None, alone: bool = False) -> bool:
    """Join the torch.distributed group described by torchrun's environment (`dist_env`): the one
    way rlplex forms a group (trainer ranks, node checks, `SyncRl` ranks).

    False when there is no group to join (one rank, unless `alone`) or this process is in one
    already. The ranks join the store as clients (TORCHELASTIC_USE_AGENT_STORE=True): it is served
    on a loopback-bound socket by the round's rank-0 node or by the launcher (`serve_tcp_store`),
    never by rank 0's own TCPStore, which would listen on every interface. The timeout of every
    collective is `timeout_s`, else RLPLEX_DIST_TIMEOUT_S, else 300 s."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not alone:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if timeout_s is None:
        timeout_s = float(os.environ.get("RLPLEX_DIST_TIMEOUT_S", "300"))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return True


def leave_group(timeout_s: float = 30.0) -> None:
    """Leave the group together: rank 0 serves the group's store under plain torchrun, and a rank
    whose gloo threads still talk to a store that is gone aborts at exit ("terminate called
    without an active exception"). A peer that died or hangs only costs the timeout."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
            else:
                dist.barrier()
    dist.destroy_process_group()


def run_entry(target: str, config_json: str) -> int:
    """Rebuild the config from its JSON, join the group, call the function; its exit code."""
    from pydantic import ValidationError

    from rlplex.config import format_validation_error

    function, model = load_function(target)
    try:
        config = model.model_validate_json(config_json)
    except ValidationError as error:
        print(format_validation_error(f"{target}: config", error), file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    owns_group = join_group()
    try:
        result = function(config)
    finally:
        if owns_group:
            leave_group()
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    install_stop_handlers()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rlplex.control.elastic.entry MODULE:FUNCTION < CONFIG.json", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        return run_entry(args[0], sys.stdin.read())
    finally:
        # The work is over. Python gives SIGTERM its default action back while it finalizes
        # (torch's teardown takes seconds on a busy machine), so a repeated stop request landing
        # then would turn this clean exit into -15, which the ElasticMaster reads as a crash and
        # answers with a restart. A hard stop still ends the process: `kill_tree` escalates to SIGKILL.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    # Through the imported module: run as __main__, this file's `_STOP` would be a second event,
    # not the one the function reads through `rlplex.control.elastic.entry.stop_event()`.
    from rlplex.control.elastic.entry import main as entry_main

    raise SystemExit(entry_main())
