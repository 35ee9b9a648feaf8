"""A master that dies (SIGKILL of its own process) at a chosen point of its first restart, for the
failover tests: `python dying_master.py POINT JOB_TOML`.

POINT 'in-decision': while it records the restart decision (at the node's PENDING transition);
'before-launch': after the decision, before launching the replacement process."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from rlplex.control import PrimeMaster


def die(*_: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def main(point: str, job_file: str) -> None:
    master = PrimeMaster.create(job_file)
    if point == "in-decision":
        record = master.store.record_transition

        def record_or_die(job_id: str, entity: str, old: str, new: str, cause: str) -> None:
            if new == "PENDING" and old != "STOPPED":
                die()
            record(job_id, entity, old, new, cause)

        master.store.record_transition = record_or_die  # type: ignore[method-assign]
    elif point == "before-launch":
        master.manager.scheduler.restart = die  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown point {point!r}")
    master.start()
    master.wait()


if __name__ == "__main__":
    main(*sys.argv[1:3])
