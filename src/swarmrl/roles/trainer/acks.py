"""Acknowledgements of used-up submissions, posted off the training step's path.

A step's acknowledgement (``/batches/ack``) tells the orchestrator which submissions the trainer
has used up, so its admission control stops counting them as held. Posted in line, it cost the
step one round trip to the orchestrator each time (150 ms across a WAN link) before the next
batch could even be asked for. :class:`Acknowledger` posts them from a thread of its own, on a
client of its own (the batch requests hold theirs while the orchestrator holds an empty answer):

- ``send(ids)`` returns at once; ids sent while a request is in flight go together in the next;
- each request is retried as before (``swarmrl.rolekit.toolkit.retry``, ``swarm.give_up_s``);
  a failure that outlives the retry, or a refusal, is raised by the next ``send`` or ``flush``,
  so a trainer whose acknowledgements fail stops as it did when they were posted in line (ids
  the pool refused are not posted again; ids it never answered for stay queued);
- ``pending()`` is what was sent and not yet acknowledged: a checkpoint keeps it among the
  used-up submissions still to acknowledge, so a trainer restarted from it acknowledges them
  again (an acknowledgement is idempotent: the pool answers ``already`` for a trained one);
- ``flush()`` waits until everything sent is acknowledged (the run's end, ``close``).

Knows nothing about batches or steps: ids in, ``post(ids)`` and ``done(ids)`` out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from swarmrl.errors import WaitTimeout
from swarmrl.rolekit.toolkit import retry


class Acknowledger:
    """Posts acknowledgements from a thread (module docstring). ``post(ids)`` sends one
    request; ``done(ids)`` is called after it succeeded."""

    def __init__(
        self,
        post: Callable[[list[str]], object],
        done: Callable[[list[str]], None],
        log: logging.Logger,
        give_up_s: float,
        pause_s: float,
    ) -> None:
        self.post, self.done, self.log = post, done, log
        self.give_up_s, self.pause_s = give_up_s, pause_s
        self._cond = threading.Condition()
        self._queued: list[tuple[list[str], str]] = []  # (ids, what), not yet posted
        self._posting: list[str] = []  # in the request now in flight
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acknowledge", daemon=True)
        self._thread.start()

    def send(self, ids: list[str], what: str) -> None:
        """Queue ``ids`` (``what``: for the log) and return; raises an earlier failure."""
        with self._cond:
            self._raise()
            if ids:
                self._queued.append((list(ids), what))
                self._cond.notify_all()

    def pending(self) -> list[str]:
        """Sent and not yet acknowledged, in the order sent."""
        with self._cond:
            return [*self._posting, *(i for ids, _ in self._queued for i in ids)]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything sent is acknowledged (or ``timeout_s`` passes); raises a
        failure."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._error is not None or not (self._queued or self._posting),
                timeout_s,
            )
            self._raise()

    def close(self, timeout_s: float) -> None:
        """Flush for up to ``timeout_s``, then stop the thread; what is still pending stays
        unacknowledged (its batch leases run out and the pool serves it again, used once)."""
        try:
            self.flush(timeout_s)
        except Exception as exc:  # recovery intended: closing must not raise over the cause
            self.log.warning("acknowledging used-up submissions failed: %s", exc)
        finally:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout_s)

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._cond.notify_all()  # the thread may post what is still queued
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                # after a failure, nothing is posted again until the caller has heard of it
                self._cond.wait_for(
                    lambda: (self._queued and self._error is None) or self._stop.is_set()
                )
                if self._stop.is_set():
                    return
                batch, self._queued = self._queued, []
                self._posting = [i for ids, _ in batch for i in ids]
                ids = list(self._posting)
            what = "; ".join(dict.fromkeys(w for _, w in batch))
            try:
                retry(
                    lambda ids=ids: self.post(ids),
                    f"acknowledge {what} ({len(ids)})",
                    self.log,
                    give_up_s=self.give_up_s,
                    pause_s=self.pause_s,
                    stop=self._stop,
                )
            except Exception as exc:  # recovery intended: raised in the caller's thread
                with self._cond:
                    self._error = exc
                    if isinstance(exc, WaitTimeout):  # the pool stayed away: still to post
                        self._queued = [(ids, what), *self._queued]
                    self._posting = []
                    self._cond.notify_all()
                continue
            self.done(ids)
            with self._cond:
                self._posting = []
                self._cond.notify_all()
