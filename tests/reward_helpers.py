"""For the reward guard's tests: rewards that misbehave, module-level so that its worker process
imports them by name (tests/ is on the path pytest gives it), and a look at its processes."""

from __future__ import annotations

import os
from pathlib import Path


def hold_the_gil(prompt: str, completion: str, answer: str) -> float:
    """Minutes in one C call that never releases the GIL: ten million modular squarings of a
    4096-bit number (a megabyte of memory, unlike a plain power)."""
    return float(pow(3, 1 << 10**7, 10**1233 + 7) % 2)


def touch_then_hold_the_gil(prompt: str, completion: str, answer: str) -> float:
    """Creates the file the completion names (the test's sign that the call has begun), then holds the GIL."""
    Path(completion).touch()
    return hold_the_gil(prompt, completion, answer)


def exit_on_boom(prompt: str, completion: str, answer: str) -> float:
    """Ends the process that calls it on the completion "boom"; else 1.0."""
    if completion == "boom":
        os._exit(3)
    return 1.0


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper we do not control)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def reward_workers(parent: int) -> list[int]:
    """The running reward workers that `parent` started (their command line ends with its pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:  # it ended while we looked
            continue
        if len(argv) > 2 and b"reward_guard import serve" in argv[2] and argv[-2] == str(parent).encode():
            found.append(int(entry.name))
    return [pid for pid in found if running(pid)]
