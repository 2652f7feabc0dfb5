"""Requests that wait for work: an empty listing held until the pool has something to hand out.

A validator asking for submissions to check and a trainer asking for a batch would otherwise
poll: ask, get nothing, sleep, ask again; whatever arrives in between waits for the next ask
(up to the sleep, on every hop of the pipeline), and every empty ask costs a request. A
listing request may instead carry ``wait_s`` (``swarmrl.protocol.pool``: at most
``MAX_WAIT_S``): :func:`held` takes the listing at once and, while it is empty and the wait
lasts, takes it again whenever this server process stores a submission or a verdict
(:meth:`PoolChanges.notify`), and at least every ``recheck_s`` for what another server process
or the clock changed (a batch lease running out). The answer is the first non-empty listing,
or the last empty one when the wait ends.

Everything runs on the server's event loop: between a take and the wait nothing else runs, so a
change is never missed between the two. Knows nothing about what is listed beyond its being
empty (``swarmrl.pool.state.replies``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from swarmrl.pool.state.replies import empty_listing

RECHECK_S = 0.5  # a held request looks again at least this often


class PoolChanges:
    """Wakes the requests held for a pool when something was stored that may be listed."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, pool_id: str) -> None:
        """Something new in ``pool_id``: every request waiting on it takes its listing again."""
        event = self._events.pop(pool_id, None)
        if event is not None:
            event.set()

    async def wait(self, pool_id: str, timeout_s: float) -> None:
        """Until the next :meth:`notify` of ``pool_id`` or ``timeout_s``, whichever is first."""
        event = self._events.setdefault(pool_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


async def held(
    take: Callable[[], Awaitable[bytes]],
    changes: PoolChanges,
    pool_id: str,
    wait_s: float,
    recheck_s: float = RECHECK_S,
) -> bytes:
    """The listing ``take()`` returns (a ``json_object`` with one list), taken again on each
    change of ``pool_id`` while it is empty, for at most ``wait_s`` seconds."""
    body = await take()
    deadline = time.monotonic() + wait_s
    while empty_listing(body):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        await changes.wait(pool_id, min(left, recheck_s))
        body = await take()
    return body
