"""Building the dashboard's pages in a child process, so a page load cannot stall the pool API.

The orchestrator answers the pool API from one event loop that also runs its database work
(``swarmrl.pool.app``). A page built on that loop holds every heartbeat up for as long as it
takes; one built on another thread of the same process convoys with the loop on the GIL (each
holds it for up to the 5 ms switch interval while the other waits): three clients reloading the
ledger page, about seven pages a second of about a millisecond each, took the heartbeats' p50
from 0.8 to 4 ms and their p99 from 14–20 to 54–61 ms (``bench/dashboard.py``). So pages are
built in one child process (spawned at the first page, started again if it dies) that opens
its own read-only view of the same database and run directory (:class:`~.data.DataRecipe`);
the orchestrator only sends the page's name and arguments and relays the answer. At most
``queued`` pages wait for the child; :meth:`PageWork.full` tells the app to refuse more.

Knows nothing about HTTP; what a page shows is ``.pages``'.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from swarmrl.roles.orchestrator.dashboard import pages
from swarmrl.roles.orchestrator.dashboard.data import DataRecipe, RunData

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
    global _VIEW
    _VIEW = recipe.open()


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
