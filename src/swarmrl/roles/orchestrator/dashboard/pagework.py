"""Building the dashboard's pages in a child process, so a page load cannot stall the pool API.

The orchestrator answers the pool API from one event loop that also runs its database work
(``swarmrl.pool.app``). A page built on that loop holds every heartbeat up for as long as it
takes; one built on another thread of the same process convoys with the loop on the GIL (each
holds it for up to the 5 ms switch interval while the other waits): three clients reloading the
ledger page, about seven pages a second of about a millisecond each, took the heartbeats' p50
from 0.8 to 3–4 ms and their p99 from 14–20 to 54–61 ms (``bench/dashboard.py`` on a busy
2-core machine). So pages are built in one child process at low priority (started with the dashboard, and
again if it dies) that opens its own read-only view of the same database and run
directory (:class:`~.data.DataRecipe`); the orchestrator only sends the page's name and
arguments and relays the answer. At most ``queued`` pages wait for the child;
:meth:`PageWork.full` tells the app to refuse more.

Knows nothing about HTTP; what a page shows is ``.pages``'.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from swarmrl.roles.orchestrator.dashboard import pages
from swarmrl.roles.orchestrator.dashboard.data import DataRecipe, RunData

NICE = 10
_VIEW: RunData | None = None  # the child's own view (set by _open in the child)
WHAT = {  # what the app may ask the child for: a page builder or a data read
    "overview": pages.overview,
    "nodes": pages.nodes,
    "node_logs": pages.node_logs,
    "versions": pages.versions,
    "ledger": pages.ledger,
    "step_rows": RunData.step_rows,
}


def _open(recipe: DataRecipe) -> None:
    """The child's start: lower its priority below the orchestrator's, then open its view."""
    global _VIEW
    _yield_processor()
    parent = os.getppid()
    threading.Thread(target=_end_with, args=(parent,), name="parent-watch", daemon=True).start()
    _VIEW = recipe.open()
    _VIEW.verify_ledger()  # start checking the chain now, not at the first ledger page


def _end_with(parent: int) -> None:
    """End this process once ``parent`` is gone (killed, it closes nothing that would tell the
    child; a session of its own, no signal to its group reaches the child either)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _yield_processor() -> None:
    """Pages wait, heartbeats do not: a session of its own (so where Linux groups processes
    by session to share the processor, the child's share is not taken from the orchestrator's
    group), with that group's and its own scheduling priority at the lowest useful (nice 10)."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    os.nice(NICE)
    try:  # Linux with autogroup scheduling: the nice value of the session's group
        Path("/proc/self/autogroup").write_text(f"{NICE}\n")
    except OSError:
        pass


def _do(what: str, args: tuple[Any, ...]) -> Any:
    assert _VIEW is not None, "the page process was not opened"
    return WHAT[what](_VIEW, *args)


class PageWork:
    """Pages built by one child process over ``recipe``, at most ``queued`` waiting.
    Used from the event loop's thread (the counter has no lock)."""

    def __init__(self, recipe: DataRecipe, queued: int = 8) -> None:
        self.recipe, self.queued = recipe, queued
        self._waiting = 0
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the child now (it starts checking the ledger at once) rather than at the
        first page."""
        self._executor().submit(_do, "step_rows", ())

    def full(self) -> bool:
        return self._waiting >= self.queued

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_open,
                    initargs=(self.recipe,),
                )
            return self._pool

    async def run(self, what: str, *args: Any) -> Any:
        """``WHAT[what](view, *args)`` in the child. A child that died is
        :class:`BrokenProcessPool` for the calls it had; the next call starts another."""
        self._waiting += 1
        try:
            pool = self._executor()
            try:
                return await asyncio.wrap_future(pool.submit(_do, what, args))
            except BrokenProcessPool:
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                raise
        finally:
            self._waiting -= 1

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
