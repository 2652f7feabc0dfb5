"""``swarmrl relay`` served by granian instead of uvicorn (bench/granian_probes.py's granian arm).

Takes the relay's own arguments (``--upstream``, ``--publisher-key``, ``--store``, ``--port``,
``--set``; not ``--tls-cert``) and serves the same ASGI app, with the same follower, from one
granian worker process (granian's Rust HTTP/1 server, one runtime thread, the app on a uvloop
event loop). granian parses HTTP itself: ``swarmrl.protocol.http_limits`` and the zero-copy
extension do not apply, so shard bodies go through ASGI in chunks (the app's public path);
granian's own ``header_read_timeout`` is set to ``shardcast.header_timeout_s`` and its buffer to
``shardcast.max_header_bytes``. Prints ``serving on URL`` once the app answers, as the relay does.
Needs ``pip install granian`` (not a swarmrl dependency).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

ARGV = "SWARMRL_GRANIAN_RELAY_ARGV"  # the arguments, handed to the worker


def app() -> Any:
    """The relay app of the arguments in ``$ARGV``, its follower started (granian's factory)."""
    from swarmrl.config.args import config_from_args
    from swarmrl.roles.relay import cli

    args = cli._parser().parse_args(json.loads(os.environ[ARGV]))
    built, follower = cli.build(args, config_from_args(args))
    follower.start()
    return built


def _announce(port: int, timeout_s: float = 60.0) -> None:
    """Print ``serving on URL`` once the worker answers ``/health``."""
    import httpx

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                print(f"serving on {url}", flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def main(argv: list[str]) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops
    from granian.http import HTTP1Settings

    from swarmrl.config.args import config_from_args
    from swarmrl.roles.relay import cli

    args = cli._parser().parse_args(argv)
    cfg = config_from_args(args).shardcast
    port = args.port
    if port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    os.environ[ARGV] = json.dumps([*argv, "--port", str(port)])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    threading.Thread(target=_announce, args=(port,), daemon=True).start()
    Granian(
        "granian_relay:app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        runtime_threads=1,
        loop=Loops.uvloop,
        http1_settings=HTTP1Settings(
            keep_alive=True,
            header_read_timeout=int(cfg.header_timeout_s * 1000),
            max_buffer_size=cfg.max_header_bytes,
        ),
        factory=True,
        log_level="warning",
    ).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
