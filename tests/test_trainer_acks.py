"""The acknowledger posts off the caller's path: ids sent while a post is in flight go together
in the next, a failure reaches the caller, and nothing sent is forgotten."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from swarmrl.errors import Conflict, InfraError, WaitTimeout
from swarmrl.roles.trainer.acks import Acknowledger


class Pool:
    """Records each post; a post waits for ``gate``; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        self.posts: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.down = False

    def post(self, ids: list[str]) -> None:
        self.gate.wait(10)
        if self.down:
            raise InfraError("connection refused")
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.posts.append(ids)


def _acker(pool: Pool, done: list[str], give_up_s: float = 5.0) -> Acknowledger:
    return Acknowledger(pool.post, done.extend, logging.getLogger("test"), give_up_s, 0.05)


def test_sends_return_at_once_and_join_the_next_post_while_one_is_in_flight():
    pool, done = Pool(), []
    acker = _acker(pool, done)
    pool.gate.clear()
    started = time.monotonic()
    acker.send(["a", "b"], "step 0")
    time.sleep(0.1)  # the thread has taken a and b
    acker.send(["c"], "step 1")
    acker.send(["d"], "filtered")
    assert time.monotonic() - started < 1.0
    assert acker.pending() == ["a", "b", "c", "d"]
    pool.gate.set()
    acker.flush(10)
    assert pool.posts == [["a", "b"], ["c", "d"]]
    assert done == ["a", "b", "c", "d"] and acker.pending() == []
    acker.close(5)


def test_a_refusal_reaches_the_next_send_and_its_ids_are_not_posted_again():
    pool, done = Pool(), []
    acker = _acker(pool, done)
    pool.fail = Conflict("submissions ['x'] were never served to a trainer")
    acker.send(["x"], "step 0")
    with pytest.raises(Conflict, match="never served"):
        acker.flush(10)
    acker.send(["y"], "step 1")  # the error was heard: posting goes on
    acker.flush(10)
    assert pool.posts == [["y"]] and done == ["y"]
    acker.close(5)


def test_ids_the_pool_never_answered_for_stay_queued_and_are_posted_later():
    pool, done = Pool(), []
    acker = _acker(pool, done, give_up_s=0.3)
    pool.down = True  # every post fails to connect until the retry gives up
    acker.send(["x"], "step 0")
    with pytest.raises(WaitTimeout, match="acknowledge step 0"):
        acker.flush(10)
    assert acker.pending() == ["x"]  # a checkpoint now keeps x to acknowledge
    pool.down = False
    acker.send(["y"], "step 1")
    acker.flush(10)
    assert pool.posts == [["x", "y"]] and done == ["x", "y"]
    acker.close(5)


def test_close_posts_what_is_queued_then_stops():
    pool, done = Pool(), []
    acker = _acker(pool, done)
    pool.gate.clear()
    acker.send(["a"], "last step")
    threading.Timer(0.3, pool.gate.set).start()
    acker.close(10)
    assert done == ["a"]
    assert not acker._thread.is_alive()
