"""The load generator of ``bench/pool.py``: simulated nodes on one event loop per client process.

Each node (:class:`WireNode`) keeps its own kept-alive HTTP/1.1 connection, one request at a
time on it, signs every request exactly as ``PoolClient`` does, and writes its HTTP by hand
(a fraction of a millisecond per request, on the cores the server shares). :func:`node_life`
is a worker's schedule: heartbeats on a fixed grid at the node's own phase, and a loop of lease,
"generate" (sleep), submit. :class:`Recorder` keeps the latency of every call started inside the
measured window; :func:`drive_process` runs one client process's share of the nodes and returns
its recorder for ``bench/pool.py`` to summarise.

The load generator must not add pauses of its own to what it measures: a call's latency runs
from its request written to its answer read *in the client's event loop*, so anything that
stops that loop while calls are in flight is counted as the server's time. Python's cyclic
garbage collector did exactly that: a client process driving 2,500 nodes collected its
middle generation every 15 s or so, taking 87–150 ms (its oldest: 144 and 316 ms) with the loop
stopped, and every call in flight on it took that much longer, the server's p99 at 5,000 nodes
included. So each client process collects once, freezes what it holds
(``gc.freeze``) and runs the window with the collector off (the nodes' garbage is freed by
reference counting; a few minutes' cycles are kept); ``--client-gc`` leaves it on, to see the
difference. A probe task wakes every 10 ms in each client process and records how late it
woke: "client stall" is the longest such delay in the window, the most the load generator
itself can have added to any one call.

The window opens at a fixed time given by ``bench/pool.py`` (after ``--warmup``), or, where
``args.joined_dir`` is set (``bench/pieces.py``), ``args.settle_s`` after the last node of
every client process joined (:func:`window_after_joins`): a loaded machine may take longer
than any fixed warm-up to join 5,000 nodes, and a window spent on joins measures them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvloop

from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.protocol.pool import Heartbeat, Submission, WorkUnit
from swarmrl.rolekit.ticks import FixedRate
from swarmrl.testing.pool_nodes import CPU_NODE, synthetic_samples

POOL = "bench"
JOIN_BODY = json.dumps({"metadata": CPU_NODE.model_dump(mode="json")}).encode()


class Refused(Exception):
    """The orchestrator answered 4xx/5xx (``code``: the pool's error code or ``http_<status>``)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class WireNode:
    """One simulated node: a key pair and one kept-alive connection, one request at a time."""

    def __init__(self, host: str, port: int, keypair: KeyPair, timeout_s: float) -> None:
        self.host, self.port, self.keypair, self.timeout_s = host, port, keypair, timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def _drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def call(self, path: str, body: bytes, timings: list[float] | None = None) -> Any:
        """POST a signed ``body`` to ``path``; the parsed JSON answer, or :class:`Refused`.

        ``timings`` gets the seconds from writing the request to reading the whole answer."""
        async with self.lock:
            if self.writer is None or self.writer.is_closing():
                await self._connect()
            headers = sign_request(self.keypair, "POST", path, body)
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            request = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{head}\r\n"
            ).encode() + body
            assert self.writer is not None and self.reader is not None
            started = time.perf_counter()
            try:
                self.writer.write(request)
                status, payload, close = await asyncio.wait_for(self._answer(), self.timeout_s)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                self._drop()
                raise Refused(type(exc).__name__) from exc
            finally:  # a call that timed out or broke counts with the time it took
                if timings is not None:
                    timings.append(time.perf_counter() - started)
            if close:
                self._drop()
        answer = json.loads(payload) if payload else None
        if status >= 400:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise Refused(str(error.get("code") or f"http_{status}"))
        return answer

    async def _answer(self) -> tuple[int, bytes, bool]:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        body = await self.reader.readexactly(int(fields.get("content-length", "0")))
        return status, body, fields.get("connection", "").lower() == "close"


class Recorder:
    """Latencies and refusals of calls that start inside the wall-clock window [t0, t1)."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.lat: dict[str, list[float]] = {}
        self.moments: list[tuple[float, float]] = []  # (seconds into the window, latency)
        self.errors: dict[str, int] = {}
        self.joined_at = float("nan")  # when this process's last node had joined
        self.join_errors: dict[str, int] = {}  # refused or timed-out joins (retried)
        self.stall_s = 0.0  # the client loop's longest delay inside the window (probe_loop)
        self.answered = 0  # calls answered inside the window, whenever they started

    async def timed(self, kind: str, node: WireNode, path: str, body: bytes) -> Any:
        """``node.call``, timed if it starts in the window; refusals counted, not raised."""
        begun = time.time()
        counted = self.t0 <= begun < self.t1
        timings: list[float] | None = self.lat.setdefault(kind, []) if counted else None
        try:
            answer = await node.call(path, body, timings)
            self.answered += self.t0 <= time.time() < self.t1
            return answer
        except Refused as exc:
            if exc.__cause__ is None:  # an HTTP answer refusing it, not a broken connection
                self.answered += self.t0 <= time.time() < self.t1
            if counted:
                key = f"{kind}: {exc.code}"
                self.errors[key] = self.errors.get(key, 0) + 1
            return None
        finally:
            if timings:
                self.moments.append((begun - self.t0, timings[-1]))


async def node_life(
    node: WireNode, rec: Recorder, args: argparse.Namespace, stop: asyncio.Event
) -> None:
    rng = random.Random(node.keypair.node_id)
    base = f"/pools/{POOL}"

    async def beats() -> None:
        # the worker's schedule: a fixed grid at the node's own phase (swarmrl.rolekit.ticks)
        ticks = FixedRate.random_phase(args.beat_s, time.monotonic(), rng)
        while not stop.is_set():
            await asyncio.sleep(ticks.wait_s(time.monotonic()))
            beat = Heartbeat(
                status="ok",
                model_version=0,
                tokens_per_s=100.0,
                log_tail=[f"step ok at {time.time():.0f}"],
            )
            await rec.timed("heartbeat", node, f"{base}/heartbeat", beat.model_dump_json().encode())
            ticks.advance(time.monotonic())

    async def work() -> None:
        await asyncio.sleep(rng.random() * args.unit_s)
        while not stop.is_set():
            reply = await rec.timed("lease", node, f"{base}/lease", b"")
            if not reply or reply.get("work") is None:
                await asyncio.sleep(args.beat_s)
                continue
            unit = WorkUnit.model_validate(reply["work"])
            await asyncio.sleep(args.unit_s)
            samples = synthetic_samples(unit, 0, rng=rng)
            body = Submission(lease_id=unit.lease_id, samples=samples).model_dump_json().encode()
            await rec.timed("submit", node, f"{base}/submissions", body)

    await asyncio.gather(beats(), work())


async def probe_loop(rec: Recorder, period_s: float = 0.01) -> None:
    """Record in ``rec.stall_s`` the longest this event loop was late waking a sleep of
    ``period_s`` inside the window: what the load generator itself added to a call at most."""
    while time.time() < rec.t1:
        asleep = time.perf_counter()
        await asyncio.sleep(period_s)
        late = time.perf_counter() - asleep - period_s
        if time.time() >= rec.t0:
            rec.stall_s = max(rec.stall_s, late)


async def drive(url: str, n_nodes: int, args: argparse.Namespace, t0: float, t1: float) -> Recorder:
    """Join ``n_nodes`` nodes, run them until ``t1``, and return what was recorded."""
    rec = Recorder(t0, t1)
    where = urlsplit(url)
    host, port = where.hostname or "127.0.0.1", where.port or 80
    nodes = [WireNode(host, port, KeyPair.generate(), timeout_s=60) for _ in range(n_nodes)]
    gate = asyncio.Semaphore(16)

    async def join(node: WireNode) -> bool:
        """Join, retrying a refusal or timeout up to 5 times (each counted); True if joined."""
        for _ in range(5):
            async with gate:
                try:
                    await node.call(f"/pools/{POOL}/join", JOIN_BODY)
                    return True
                except Refused as exc:
                    key = f"join: {exc.code}"
                    rec.join_errors[key] = rec.join_errors.get(key, 0) + 1
            await asyncio.sleep(1.0)
        return False

    joined = await asyncio.gather(*(join(node) for node in nodes))
    nodes = [node for node, ok in zip(nodes, joined, strict=True) if ok]
    rec.joined_at = time.time()
    if getattr(args, "joined_dir", None):
        rec.t0, rec.t1 = await window_after_joins(args, rec.joined_at)
        t1 = rec.t1
    if not args.client_gc:  # module docstring
        gc.collect()
        gc.freeze()
        gc.disable()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(node_life(node, rec, args, stop)) for node in nodes]
    tasks.append(asyncio.create_task(probe_loop(rec)))
    await asyncio.sleep(max(0.0, t1 - time.time()))
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for node in nodes:
        node._drop()
    if not args.client_gc:
        gc.enable()
        gc.unfreeze()
    return rec


async def window_after_joins(args: argparse.Namespace, joined_at: float) -> tuple[float, float]:
    """The window ``args.settle_s`` after the last of ``args.joined_count`` client processes
    had all its nodes joined (each leaves the time in a file under ``args.joined_dir``), the
    same in every process: (t0, t1)."""
    where = Path(args.joined_dir)
    (where / f"{os.getpid()}.tmp").write_text(repr(joined_at))
    (where / f"{os.getpid()}.tmp").replace(where / f"{os.getpid()}.joined")
    deadline = time.time() + 900
    while len(found := list(where.glob("*.joined"))) < args.joined_count:
        if time.time() > deadline:
            raise TimeoutError("the other client processes did not finish joining in 900 s")
        await asyncio.sleep(0.1)
    t0 = max(float(f.read_text()) for f in found) + args.settle_s
    return t0, t0 + args.duration


def drive_process(job: tuple) -> Recorder:
    """One client process: ``drive`` on uvloop; what it recorded."""
    url, n_nodes, args, t0, t1 = job
    return uvloop.run(drive(url, n_nodes, args, t0, t1))
