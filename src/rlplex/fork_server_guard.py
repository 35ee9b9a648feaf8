"""Imported only by the fork server of `rlplex.processes` (first of its preloads): the server
gets SIGKILL the moment its launcher dies, however it dies.

Without it the server leaves when it reads the end of its "alive" pipe, after a wake-up and an
interpreter shutdown; its children (SIGTERMed when it exits) would meanwhile go on writing, e.g.
a snapshot after their launcher was SIGKILLed. A fork's children do not inherit the request.
"""

from __future__ import annotations

import signal
import sys

from rlplex.processes import die_with_parent

# A fork server runs `python -c "from multiprocessing.forkserver import main; ..."`.
if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    die_with_parent(signal.SIGKILL)
