"""Event loops owned by a component (not by `asyncio.run`): closed without leaving tasks behind."""

from __future__ import annotations

import asyncio


async def _cancel_others() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's pending tasks (a step that failed half-way, a request a hung server never
    answered), stop its default executor, close it."""
    if loop.is_closed():
        return
    loop.run_until_complete(_cancel_others())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
