"""A two-rank script whose first round ends with rank 0 failing while rank 1 is blocked in a wait
on the round's store, as a multi-run trainer rank waits for rank 0's state snapshot. Rank 1 takes
SIGTERM as a graceful stop, but its handler cannot run until the C++ wait returns. In the next
round (RLPLEX_RESTART_COUNT 1) both ranks exit 0."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path


def main() -> int:
    if os.environ["RLPLEX_RESTART_COUNT"] != "0":
        return 0
    rank = int(os.environ["RANK"])
    blocked = Path(os.environ["RLPLEX_CHECKPOINT_DIR"]) / "rank1_blocked"
    if rank == 0:
        deadline = time.monotonic() + 120
        while not blocked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # a poll of the file rank 1 writes, not a synchronisation by time
        return 1
    import torch.distributed as dist

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # graceful, once it can run
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=300)
    )
    blocked.write_text("waiting")
    store.wait(["rank 0 never sets this"], timedelta(seconds=300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
