"""``swarmrl relay``: follow upstreams, verify every shard against the signed manifest, serve.

    swarmrl relay [CONFIG] --upstream URL[,URL…] --publisher-key KEY --store DIR
                  [--host H] [--port P] [--set shardcast.key=value …]

Reads the ``[shardcast]`` section of ``CONFIG`` (default: the embedded config) plus ``--set``
overrides; its ``/health`` answers with the settings it applies. Imports neither torch nor
transformers: a relay installs and starts light.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarmrl.config import SwarmConfig
from swarmrl.config.args import add_config_args, config_from_args
from swarmrl.identity.keys import parse_public_keys
from swarmrl.rolekit.toolkit import StatusReporter, add_tls_args, log_config, setup_logging
from swarmrl.serving import Tls

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from swarmrl.shardcast.relay import Follower


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl relay", description="run a weight relay following upstreams"
    )
    add_config_args(parser)
    parser.add_argument("--upstream", required=True, help="URL[,URL…] of origins or relays")
    parser.add_argument(
        "--publisher-key", required=True, help="trusted publisher key: hex or key file"
    )
    parser.add_argument(
        "--store", required=True, help="directory for the versions this relay holds"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8471)
    add_tls_args(parser)
    parser.add_argument("--name", default="relay", help="name shown in logs")
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO, DEBUG, …)")
    parser.add_argument(
        "--status-dir", default=None, help="write <name>.json status reports into this directory"
    )
    return parser


def build(args: argparse.Namespace, config: SwarmConfig) -> tuple[Starlette, Follower]:
    """The relay's app and follower from parsed arguments (nothing is started yet)."""
    from swarmrl.shardcast.catalog import Catalog
    from swarmrl.shardcast.relay import Follower
    from swarmrl.shardcast.server import build_app

    cfg = config.shardcast
    catalog = Catalog(args.store, cfg.keep_versions)
    upstreams = [u.strip() for u in args.upstream.split(",") if u.strip()]
    follower = Follower(upstreams, parse_public_keys(args.publisher_key), catalog, cfg)
    return build_app(catalog, cfg, role="relay"), follower


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    config = config_from_args(args)
    parse_public_keys(args.publisher_key)  # a bad key is refused before the first log line
    tls = Tls.from_flags(args.tls_cert, args.tls_key)
    log_config(setup_logging(args.name, args.log_level), config)
    from swarmrl.shardcast.server import serve_until_signal

    app, follower = build(args, config)

    def refresh(reporter: StatusReporter) -> None:
        latest = follower.catalog.latest(complete_only=True)
        reporter.set(
            state="serving" if latest is not None else "waiting for the first version",
            version=latest,
            replication_errors=len(follower.errors),
        )

    reporter = StatusReporter(
        "relay", args.name, args.status_dir, config.swarm.status_interval_s, refresh=refresh
    )
    with reporter:
        follower.start()
        return serve_until_signal(app, args.host, args.port, on_stop=follower.stop, tls=tls)
