"""``swarmrl orchestrator`` served by granian instead of uvicorn (bench/pieces.py's granian arm).

Takes the orchestrator's own arguments (``--key``, ``--run-dir``, ``--port``, ``--port-file``,
``--pool``, ``--set``; not ``--fronts`` or ``--workers``), and ``--head-timeout-s S`` (granian's
``header_read_timeout``; default the orchestrator's head timeout, 10 s), and serves the same ASGI app from one
granian worker process (granian's Rust HTTP/1 server, one runtime thread, the app on a uvloop
event loop, as uvicorn serves it). granian parses HTTP itself, so uvicorn's direct lane and
``swarmrl.protocol.http_limits`` do not apply; the hot routes answer inside the ASGI app.
The port file is written by the worker once its app is built (granian binds the socket before
it starts the worker). Needs ``pip install granian`` (not a swarmrl dependency).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

ARGV = "SWARMRL_GRANIAN_ORCHESTRATOR_ARGV"  # the arguments, handed to the worker


def app() -> Any:
    """The orchestrator app of the arguments in ``$ARGV`` (granian's factory, in the worker)."""
    from swarmrl.identity.keys import load_keypair
    from swarmrl.pool.server import make_context
    from swarmrl.pool.trust import service
    from swarmrl.pool.web.app import build_app
    from swarmrl.roles.orchestrator import cli
    from swarmrl.serving import FullCollections

    args = cli._parser().parse_args(json.loads(os.environ[ARGV]))
    config = cli.pool_config(args)
    ctx = make_context(load_keypair(args.key), args.run_dir, config)
    for _, spec in cli.pool_specs(args):
        service.create_pool(ctx, spec)
    built = build_app(ctx)
    FullCollections(config.full_gc_every_s).start()
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(f"{args.port}\n")
        tmp.replace(args.port_file)
    return built


def main(argv: list[str]) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops
    from granian.http import HTTP1Settings

    from swarmrl.pool.server import ORCHESTRATOR_LIMITS
    from swarmrl.roles.orchestrator import cli

    head_timeout_s = ORCHESTRATOR_LIMITS.head_timeout_s
    if "--head-timeout-s" in argv:
        at = argv.index("--head-timeout-s")
        head_timeout_s = float(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    args = cli._parser().parse_args(argv)
    port = args.port
    if port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
    argv = [*argv, "--port", str(port)]
    os.environ[ARGV] = json.dumps(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    Granian(
        "granian_orchestrator:app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        runtime_threads=1,
        loop=Loops.uvloop,
        backlog=4096,
        http1_settings=HTTP1Settings(
            keep_alive=True,
            header_read_timeout=int(head_timeout_s * 1000),
            max_buffer_size=ORCHESTRATOR_LIMITS.max_head_bytes,
        ),
        factory=True,
        log_level="warning",
    ).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
