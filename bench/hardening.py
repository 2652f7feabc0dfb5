"""What the trusted side's defences against hostile input cost, each against a baseline measured
in the same run.

    python bench/hardening.py sandbox    [--repeat N] [--trials K]
    python bench/hardening.py serve      [--repeat N] [--run-dir DIR]
    python bench/hardening.py http       [--repeat N]
    python bench/hardening.py checkpoint [--repeat N] [--trials K]

- ``sandbox``: wall and CPU time (this process plus its children) of ``Sandbox.run("pass")`` in
  every mode that starts here (``bwrap``, ``unshare``, ``rlimit``; a mode that cannot start is
  named with its reason), against ``subprocess.run([python, "-c", "pass"])`` with the same
  interpreter, and against ``python -I -c pass`` (the flag every mode runs the program with:
  no user site, no environment). The modes and the baselines take turns, trial by trial, so the
  machine's load falls on all of them alike. The difference to the baselines is what isolation
  adds.
- ``serve``: a ``swarmrl serve`` process (built from a short ``swarmrl run configs/arith.toml
  --colocated`` unless ``--run-dir`` names one) gets a small ordinary chat and chats whose prompt
  is 1, 8 and 32 MiB, in turn; for each, the status (or the client's error), the seconds to the
  answer, and how far the server's resident memory peaked above what it held before the request
  (``VmHWM`` after resetting it through ``/proc/PID/clear_refs``). Two servers: the default
  limits (the 1 MiB body cap answers) and ``--max-body-bytes 64 MiB``, where the prompt-length
  cap answers what reaches it, before the prompt is tokenized (the HTTP layer under the app
  keeps its own 8 MiB body cap, ``HttpLimits.max_body_bytes``, which answers larger bodies).
- ``http``: an orchestrator in this process (``max_body_bytes`` 4 MiB, 2 s head, keep-alive and
  body timeouts, as tests/test_http_hostile.py runs it), on a path its direct lane answers
  (heartbeat) and one FastAPI answers (join). Peak RSS growth of this process while 3 idle
  connections wait (the baseline), while 3 sockets trickle 1.5 MB of 2-byte chunks, and while one
  socket sends a 28 MiB body (declared by Content-Length, or chunked in 64 KiB chunks); for
  each socket the status answered and whether, and after how many seconds, the server
  closed it. The sending threads share this process: their payloads are built before the peak is
  reset, and sending a ``bytes`` object allocates next to nothing.
- ``checkpoint``: one ``Checkpointer.save`` (model, AdamW state, RNG, source state) of the
  embedded default config's model (the demo), against one ``policy_step`` on a batch of that
  config's size (prompts_per_step x group_size rows of 20 tokens), alternated; one torch thread.

Every figure is a median with its range (min-max) over the samples; a progress line goes to
stderr as each sample is taken and a JSON summary to stdout at the end. Times on a loaded machine
grow with the load: compare a figure only with its baseline from the same run. Knows nothing
about thresholds: it measures and prints, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_requests import exchange  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def progress(message: str) -> None:
    print(f"[hardening] {message}", file=sys.stderr, flush=True)


def summary(samples: list[float], digits: int = 1) -> dict[str, Any]:
    """Median and range of ``samples``, rounded to ``digits``."""
    return {
        "median": round(statistics.median(samples), digits),
        "min": round(min(samples), digits),
        "max": round(max(samples), digits),
        "n": len(samples),
    }


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children, user and system."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def memory_kib(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak since the last reset) of process ``pid``, KiB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def reset_peak(pid: int | str = "self") -> int:
    """Reset ``VmHWM`` of ``pid`` to its current RSS; returns that RSS, KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory_kib(pid)["VmRSS"]


# --- sandbox ---------------------------------------------------------------------------------


def bench_sandbox(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    from swarmrl.envs.sandbox import Sandbox, default_python
    from swarmrl.errors import SandboxError

    logging.disable(logging.WARNING)  # rlimit's "runs unisolated" warning, once per Sandbox
    python = default_python()
    runners: dict[str, Callable[[], None]] = {}

    def plain() -> None:
        subprocess.run([python, "-c", "pass"], check=True)

    def isolated() -> None:  # the interpreter flag every mode runs the program with
        subprocess.run([python, "-I", "-c", "pass"], check=True)

    runners["baseline: python -c pass"] = plain
    runners["baseline: python -I -c pass"] = isolated
    skipped = {}
    for mode in ("bwrap", "unshare", "rlimit"):
        try:
            box = Sandbox(mode=mode)
        except SandboxError as exc:
            skipped[mode] = str(exc)
            progress(f"sandbox: {mode} cannot start here: {exc}")
            continue

        def run(box: Sandbox = box, mode: str = mode) -> None:
            result = box.run("pass")
            if result.verdict != "ok":
                raise RuntimeError(f"{mode}: Sandbox.run('pass') ended {result.verdict}")

        runners[mode] = run
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for rep in range(args.repeat):
        for trial in range(args.trials):
            shift = (rep * args.trials + trial) % len(names)  # rotate who goes first
            for name in names[shift:] + names[:shift]:
                c0, t0 = cpu_s(), time.perf_counter()
                runners[name]()
                wall[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((cpu_s() - c0) * 1e3)
        progress(f"sandbox: repeat {rep + 1}/{args.repeat} done ({args.trials} trials per mode)")
    return {
        "python": python,
        "skipped": skipped,
        "wall_ms": {k: summary(v) for k, v in wall.items()},
        "cpu_ms": {k: summary(v) for k, v in cpu.items()},
    }


# --- serve -----------------------------------------------------------------------------------

SHORT_POLICY = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "sft.steps=5",
    "sft.train_examples=200",
    "rl.steps=1",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "eval.n=8",
    "eval.control=false",
]


def short_policy(root: Path) -> Path:
    """The run directory of a short ``swarmrl run configs/arith.toml --colocated``."""
    sets = [*SHORT_POLICY, f'run.run_dir="{root / "runs"}"', f'run.cache_dir="{root / "cache"}"']
    argv = [sys.executable, "-m", "swarmrl.cli", "run", str(ROOT / "configs" / "arith.toml")]
    argv += ["--colocated", "--quiet", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"swarmrl run failed:\n{done.stdout}{done.stderr}")
    (run_dir,) = (root / "runs").iterdir()
    return run_dir


def chat_body(prompt_bytes: int) -> bytes:
    content = "1+2=" if prompt_bytes == 0 else "1" * prompt_bytes
    return json.dumps(
        {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    ).encode()


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from swarmrl.testing.serve import ServeProcess

    with tempfile.TemporaryDirectory(prefix="hardening-serve-") as tmp:
        if args.run_dir:
            run_dir = Path(args.run_dir)
        else:
            progress("serve: training a short policy (swarmrl run configs/arith.toml --colocated)")
            run_dir = short_policy(Path(tmp))
        sizes = {"small chat (baseline)": 0, "1 MiB prompt": 1 << 20}
        sizes |= {"8 MiB prompt": 8 << 20, "32 MiB prompt": 32 << 20}
        bodies = {name: chat_body(n) for name, n in sizes.items()}
        servers = {
            "default limits": [],
            "--max-body-bytes 64 MiB": ["--max-body-bytes", "67108864"],
        }
        out: dict[str, Any] = {}
        for server_name, flags in servers.items():
            seconds: dict[str, list[float]] = {k: [] for k in bodies}
            grew: dict[str, list[float]] = {k: [] for k in bodies}
            answers: dict[str, set[str]] = {k: set() for k in bodies}
            with ServeProcess(run_dir, *flags) as server, httpx.Client(timeout=120) as client:
                client.post(
                    server.url + "/v1/chat/completions", content=bodies["small chat (baseline)"]
                )
                for rep in range(args.repeat):
                    for name, body in bodies.items():
                        before = reset_peak(server.proc.pid)
                        t0 = time.perf_counter()
                        try:
                            answer = client.post(
                                server.url + "/v1/chat/completions",
                                content=body,
                                headers={"Content-Type": "application/json"},
                            )
                            seen = str(answer.status_code)
                        except httpx.HTTPError as exc:  # the server may close while we send
                            seen = type(exc).__name__
                        seconds[name].append(time.perf_counter() - t0)
                        grew[name].append((memory_kib(server.proc.pid)["VmHWM"] - before) / 1024)
                        answers[name].add(seen)
                        progress(
                            f"serve [{server_name}] {rep + 1}/{args.repeat} {name}: {seen} in "
                            f"{seconds[name][-1]:.2f} s, peak RSS {grew[name][-1]:+.1f} MiB"
                        )
            out[server_name] = {
                name: {
                    "answer": sorted(answers[name]),
                    "seconds": summary(seconds[name], 3),
                    "peak_rss_growth_mib": summary(grew[name]),
                }
                for name in bodies
            }
    return out


# --- http ------------------------------------------------------------------------------------

HEARTBEAT = "/pools/p1/heartbeat"  # the orchestrator's direct lane answers it
JOIN = "/pools/p1/join"  # FastAPI answers it


def _trickle(path: str, wire_bytes: int) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    return head + b"2\r\nab\r\n" * (wire_bytes // 7)


def _chunked(path: str, body_bytes: int, chunk_bytes: int = 64 << 10) -> bytes:
    """A chunked POST of ``body_bytes`` in ``chunk_bytes`` chunks, ended properly."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n" % chunk_bytes + b"1" * chunk_bytes + b"\r\n"
    return head + chunk * (body_bytes // chunk_bytes) + b"0\r\n\r\n"


def _declared(path: str, body_bytes: int) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_bytes}\r\n\r\n"
    ).encode()
    return head + b"1" * body_bytes


def _hold(
    address: tuple[str, int], data: bytes, start: float, within_s: float
) -> tuple[str, float | None]:
    """Send ``data`` (the server may cut it short) and read until the server closes: the status
    it answered ("none" when it closed without one), and seconds from ``start`` to the close
    (None when it stayed open for ``within_s``)."""
    answer, closed_at = exchange(address, data, start, start + within_s)
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
    return status, closed_at


def bench_http(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    from swarmrl.config.pool import PoolConfig
    from swarmrl.identity import KeyPair
    from swarmrl.pool.server import OrchestratorServer, make_context
    from swarmrl.protocol.http_limits import HttpLimits

    logging.disable(logging.WARNING)  # one line per refused request
    limits = HttpLimits(head_timeout_s=2.0, keep_alive_s=2.0, body_timeout_s=2.0)
    within_s = 10.0
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hardening-http-") as tmp:
        ctx = make_context(KeyPair.generate(), tmp, PoolConfig(max_body_bytes=4 << 20))
        with OrchestratorServer(ctx, limits=limits) as server:
            address = (server.host, server.port)
            for path in (HEARTBEAT, JOIN):
                cases = {
                    "3 idle connections (baseline)": [b""] * 3,
                    "3 x 1.5 MB trickled in 2-byte chunks": [_trickle(path, 1_500_000)] * 3,
                    "1 x 28 MiB body (Content-Length)": [_declared(path, 28 << 20)],
                    "1 x 28 MiB body (64 KiB chunks)": [_chunked(path, 28 << 20)],
                }
                grew: dict[str, list[float]] = {k: [] for k in cases}
                closed: dict[str, list[float | None]] = {k: [] for k in cases}
                statuses: dict[str, set[str]] = {k: set() for k in cases}
                names = list(cases)
                for rep in range(args.repeat):
                    shift = rep % len(names)  # rotate who goes first: memory freed is reused
                    for name in names[shift:] + names[:shift]:
                        payloads = cases[name]
                        before = reset_peak()
                        start = time.monotonic()
                        ends: list[tuple[str, float | None]] = [("none", None)] * len(payloads)

                        def one(i: int, data: bytes, start=start, ends=ends) -> None:
                            ends[i] = _hold(address, data, start, within_s)

                        threads = [
                            threading.Thread(target=one, args=(i, d))
                            for i, d in enumerate(payloads)
                        ]
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join(within_s + 5)
                        grew[name].append((memory_kib()["VmHWM"] - before) / 1024)
                        closed[name].extend(e for _, e in ends)
                        statuses[name].update(status for status, _ in ends)
                        shown = ", ".join(
                            f"{status} {'open' if e is None else f'closed {e:.1f} s'}"
                            for status, e in ends
                        )
                        progress(
                            f"http {path} {rep + 1}/{args.repeat} {name}: peak RSS "
                            f"{grew[name][-1]:+.1f} MiB; answered {shown}"
                        )
                out[path] = {
                    name: {
                        "peak_rss_growth_mib": summary(grew[name]),
                        "answers": sorted(statuses[name]),
                        "sockets_closed": f"{sum(e is not None for e in closed[name])}"
                        f"/{len(closed[name])} within {within_s:.0f} s",
                        "closed_after_s": summary([e for e in closed[name] if e is not None], 2)
                        if any(e is not None for e in closed[name])
                        else None,
                    }
                    for name in cases
                }
    return out


# --- checkpoint ------------------------------------------------------------------------------


def bench_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.model import build_char_tokenizer, create_tiny_model
    from swarmrl.trainer.batch import TrainBatch
    from swarmrl.trainer.checkpoint import Checkpointer
    from swarmrl.trainer.parallel import init_parallel
    from swarmrl.trainer.step import make_optimizer, policy_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_config([EMBEDDED_DEFAULT], [])
    rows, width = config.rl.prompts_per_step * config.rl.group_size, 20
    tokenizer = build_char_tokenizer("0123456789+-*= ")
    model = create_tiny_model(config.model.tiny, tokenizer)
    optimizer = make_optimizer(model, config.rl)
    parallel = init_parallel("cpu", config.trainer, rows)
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(
        torch.randint(3, len(tokenizer), (rows, width), generator=g),
        torch.ones(rows, width - 1),
        -torch.rand(rows, width - 1, generator=g),
        torch.randn(rows, 1, generator=g),
    )

    def step() -> None:
        policy_step(model, optimizer, batch, config.rl, None, config.rl.micro_batch)

    step()  # AdamW's state exists from the first step on: the checkpoint then holds all of it
    steps: list[float] = []
    saves: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hardening-ckpt-") as tmp:
        checkpointer = Checkpointer(Path(tmp) / "ck", config, parallel)
        n = 0
        for rep in range(args.repeat):
            for _ in range(args.trials):
                n += 1
                t0 = time.perf_counter()
                step()
                steps.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                path = checkpointer.save(model, optimizer, n, n, {"source": None, "history": []})
                saves.append((time.perf_counter() - t0) * 1e3)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            progress(
                f"checkpoint: repeat {rep + 1}/{args.repeat}: step "
                f"{statistics.median(steps):.0f} ms, save {statistics.median(saves):.0f} ms"
            )
    return {
        "model_params": sum(p.numel() for p in model.parameters()),
        "batch": f"{rows} rows x {width} tokens",
        "checkpoint_bytes": size,
        "training_step_ms": summary(steps),
        "checkpoint_save_ms": summary(saves),
        "save_over_step": round(statistics.median(saves) / statistics.median(steps), 3),
    }


# --- main ------------------------------------------------------------------------------------

BENCHES = {
    "sandbox": bench_sandbox,
    "serve": bench_serve,
    "http": bench_http,
    "checkpoint": bench_checkpoint,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        p = sub.add_parser(name)
        p.add_argument("--repeat", type=int, default=2, help="times to repeat the measurement")
        if name in ("sandbox", "checkpoint"):
            trials = 20 if name == "sandbox" else 10
            p.add_argument("--trials", type=int, default=trials, help="samples per repeat")
        if name == "serve":
            p.add_argument("--run-dir", help="a run directory to serve (default: train one)")
    args = parser.parse_args()
    began = time.monotonic()
    result = BENCHES[args.bench](args)
    load = Path("/proc/loadavg").read_text().split()[:3]
    result = {
        "bench": args.bench,
        "repeat": args.repeat,
        "seconds": round(time.monotonic() - began, 1),
        "load": load,
        **result,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
