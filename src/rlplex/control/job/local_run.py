"""A command that runs one local control-plane job of its own and shows one node's log.

Two commands do this: the standalone multi-run trainer (`python -m rlplex.multirun.trainer`)
and `rlplex train --supervise` (`rlplex.runners.train_node`). Each builds its job's spec from
its flags, and `run_local_job` opens the master (resuming the unfinished job of the same spec
that a killed command left, whose nodes may still run), drives the job to its end, copies the
node's log to the command's output and turns the ending into an exit code.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TextIO

from rlplex.control.job.store import STORE_FILE
from rlplex.errors import ConfigError, JobSpecError
from rlplex.processes import handle_stop_signals

if TYPE_CHECKING:
    from rlplex.control.job.master import PrimeMaster
    from rlplex.control.job.spec import JobSpec

log = logging.getLogger(__name__)


class LogTail:
    """Copies what a node's log gains from now on to `out`. The log is opened once it exists and
    read on from where it was: a restarted node appends to the same file."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out = path, out
        self._handle: BinaryIO | None = None
        # A resumed job's log holds what the last command showed already.
        self._skip = path.stat().st_size if path.exists() else 0

    def pump(self) -> None:
        if self._handle is None:
            try:
                self._handle = self.path.open("rb")
            except OSError:
                return  # not created yet
            self._handle.seek(self._skip)
        data = self._handle.read()
        if data:
            self.out.write(data.decode(errors="replace"))
            self.out.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def open_master(spec: JobSpec, say: Callable[[str], None] = log.info) -> PrimeMaster:
    """A master for the command's job: a new job, or the unfinished one already in its folder when
    that one has the same spec (the last command was killed: its nodes may still run, and
    resuming re-attaches to them instead of starting a second copy of the same work)."""
    from rlplex.control.job.master import PrimeMaster

    previous = _unfinished_spec(spec.output_dir)
    if previous is None:
        return PrimeMaster.create(spec)
    if previous.model_dump(mode="json") != spec.model_dump(mode="json"):
        raise ConfigError(
            f"{spec.output_dir}: an unfinished {spec.name} job with other settings is in this folder (its nodes "
            f"may still run); resume it as it was with 'rlplex job resume {spec.output_dir}' (Ctrl-C there "
            "stops it), then start this one"
        )
    say(f"resuming the unfinished {spec.name} job in {spec.output_dir}")
    return PrimeMaster.resume(spec.output_dir)


def _unfinished_spec(output_dir: Path) -> JobSpec | None:
    """The spec of the job in `output_dir` if one is there and has not ended."""
    from rlplex.control.job.master import resumable_spec

    if not (output_dir / STORE_FILE).exists():
        return None
    try:
        return resumable_spec(output_dir)
    except JobSpecError:
        raise  # a stored spec that no longer loads is an error to show, not "no job"
    except ConfigError:  # no job there, or it has ended
        return None


def _stop_at_once(signum: int) -> None:
    raise KeyboardInterrupt


def run_local_job(
    spec: JobSpec,
    shown_log: str,
    out: TextIO = sys.stdout,
    on_signal: Callable[[int], None] = _stop_at_once,
    on_tick: Callable[[PrimeMaster], None] | None = None,
) -> int:
    """Run `spec` to its end, showing node log `shown_log` (e.g. "trainer-0.log") on `out`.

    Exit code: 0 when every node finished, 1 when the job failed (the cause is printed), 128 +
    the signal when a signal stopped it (`on_signal` raises KeyboardInterrupt for that; by
    default the first signal does).
    """
    from rlplex.control.job.master import drive
    from rlplex.errors import JobFailedError

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    master = open_master(spec, say)
    tail = LogTail(spec.output_dir / "logs" / shown_log, out)

    def tick() -> None:
        if on_tick is not None:
            on_tick(master)
        tail.pump()

    with handle_stop_signals(on_signal) as received:
        try:
            drive(master, say, on_tick=tick)  # its last tick shows the log's end
        except JobFailedError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 128 + (received[-1] if received else signal.SIGINT)
        finally:
            tail.close()
    return 0  # every node finished: the job stopped itself
