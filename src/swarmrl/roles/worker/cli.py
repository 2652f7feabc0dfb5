"""``swarmrl worker``: run an untrusted inference node against a pool.

    swarmrl worker [CONFIG] --key worker.key --orchestrator URL --pool ID
                   --weights URL [--weights URL …] --publisher-key KEY
                   [--invite invite.json] [--work-dir DIR] [--set swarm.cheat=…]

``--weights`` lists relays first and the origin last; the client weighs sources by measured
throughput and falls back to the others when one fails. Knows only argument parsing; the node
itself is ``swarmrl.roles.worker.node``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from swarmrl.errors import MissingPathError, UserError
from swarmrl.identity import load_keypair
from swarmrl.rolekit.metrics import serve_role_metrics
from swarmrl.rolekit.supervisor import terminate_as_interrupt
from swarmrl.rolekit.toolkit import (
    StatusReporter,
    add_peer_args,
    add_role_args,
    end_process,
    load_role_config,
    log_config,
    setup_logging,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl worker",
        description="run an untrusted inference worker: lease, generate, prove, submit",
    )
    add_role_args(parser)
    add_peer_args(parser)
    parser.add_argument("--invite", default=None, help="invite JSON from the pool owner")
    parser.add_argument("--work-dir", default=None, help="weights cache (default: ./worker-NAME)")
    return parser


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    config = load_role_config(args)
    from swarmrl.inference.interface import require_backend  # after --help: imports torch

    require_backend(config.inference.backend)
    keypair = load_keypair(args.key)
    from swarmrl.identity.keys import parse_public_key
    from swarmrl.protocol.pool import Invite
    from swarmrl.rolekit.policy import set_threads
    from swarmrl.roles.worker.node import WorkerNode, WorkerSettings

    invite = None
    if args.invite:
        path = Path(args.invite)
        if not path.is_file():
            raise MissingPathError(f"invite file not found: {path}")
        try:
            invite = Invite.model_validate_json(path.read_text())
        except ValueError as exc:
            raise UserError(f"{path} is not an invite ({str(exc).splitlines()[0]})") from exc
    publisher_key = parse_public_key(args.publisher_key)
    name = args.name or f"worker-{keypair.node_id[:8]}"
    log = setup_logging(name)  # after the arguments were checked: a refusal is one line
    log_config(log, config)
    set_threads(config.swarm.role_threads)
    settings = WorkerSettings(
        orchestrator=args.orchestrator,
        pool_id=args.pool,
        weight_sources=[u for item in args.weights for u in item.split(",") if u],
        publisher_key=publisher_key,
        work_dir=Path(args.work_dir or f"worker-{name}"),
        invite=invite,
    )
    if config.swarm.cheat:
        log.warning("TEST-ONLY misbehaviour enabled: %s", config.swarm.cheat)
    status = StatusReporter(
        "worker", name, args.status_dir, config.swarm.status_interval_s, keypair.node_id
    )
    serve_role_metrics(status, args, log)
    with terminate_as_interrupt(), status:
        node = WorkerNode(config, settings, keypair, status, log)
        try:
            code = node.run()
        except KeyboardInterrupt:
            log.info("stopping")
            status.set(state="stopped")
            code = 0
    end_process(code)  # the status written, the logs flushed (see end_process)
