"""A worker's next unit, asked for while its submission is on the way.

Across a link with a round trip of 150 ms, a unit costs two trips besides its generation: the
lease and the submission. :class:`LeaseAhead` sends the next lease request beside the
submission (the pool lets a node hold ``max_leases_in_flight`` leases, 2 by default), so the
next unit is usually in hand when the submission's receipt arrives: one trip a unit. Only an
answer with work (or ``finished``) is used; a ``wait``, or any failure, was decided before the
submission landed (the node still held the unit it answers, the supply the pool counted still
included it), so the worker then asks again as it always did, and is no worse off than without
asking ahead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from swarmrl.errors import SwarmError
from swarmrl.protocol.pool import LeaseReply


class LeaseAhead:
    """One lease request at a time, sent on its own thread (module docstring).

    ``ask`` is the lease call (one request, no retries: the worker's own lease call retries).
    The request's time is bounded by the pool client's timeout, so :meth:`take` is too.
    """

    def __init__(self, ask: Callable[[], LeaseReply], log: logging.Logger) -> None:
        self._ask = ask
        self._log = log
        self._thread: threading.Thread | None = None
        self._reply: LeaseReply | None = None
        self._error: BaseException | None = None

    @property
    def asking(self) -> bool:
        """A request was sent and its answer not yet taken."""
        return self._thread is not None

    def start(self) -> None:
        """Send the request (nothing when one is already out)."""
        if self._thread is not None:
            return
        self._reply = self._error = None
        self._thread = threading.Thread(target=self._run, name="lease-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._reply = self._ask()
        except BaseException as exc:  # handed to the work thread by take()
            self._error = exc

    def take(self) -> LeaseReply | None:
        """The answer, where it holds work or says the run is finished; None where nothing was
        asked, the pool said to wait, or the request failed (the caller asks again). An error
        that is not a peer's or the network's (a defect) is raised here, on the work thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        if self._error is not None:
            if not isinstance(self._error, SwarmError):
                raise self._error
            self._log.debug("the lease asked ahead failed (%s); asking again", self._error)
            return None
        reply = self._reply
        if reply is None or reply.outcome == "wait":
            return None
        return reply
