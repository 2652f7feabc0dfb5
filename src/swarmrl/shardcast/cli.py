"""The ``swarmrl shardcast`` verb: publish, fetch and serve-origin (the relay is a role).

    swarmrl shardcast publish CKPT_DIR [CONFIG] --key KEY --store DIR [--version V]
    swarmrl shardcast fetch [CONFIG] --source URL … --out DIR --publisher-key KEY
    swarmrl shardcast serve-origin [CONFIG] --store DIR [--host H] [--port P]

Each sub-command reads the ``[shardcast]`` section of ``CONFIG`` (default: the embedded config)
and ``--set shardcast.key=value`` overrides, as every role does. Knows nothing about training;
parses arguments and calls the library.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from swarmrl.config.args import add_config_args, config_from_args
from swarmrl.identity.keys import parse_public_keys
from swarmrl.logs import configure_logging


def _common_args(parser: argparse.ArgumentParser) -> None:
    """``[CONFIG] [--set shardcast.key=value …]`` and the log level, on every sub-command."""
    add_config_args(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO, DEBUG, …)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl shardcast", description="publish and fetch signed weight versions"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="publish a checkpoint directory as a signed version")
    pub.add_argument("checkpoint_dir")
    pub.add_argument("--key", required=True, help="publisher key file (swarmrl keys)")
    pub.add_argument("--store", required=True, help="store directory an origin serves")
    pub.add_argument("--version", type=int, help="version number (default: latest + 1)")
    pub.add_argument("--step", type=int, help="trainer step (default: the version)")
    _common_args(pub)
    fetch = sub.add_parser("fetch", help="fetch a version into a directory")
    fetch.add_argument(
        "--source",
        action="extend",
        nargs="+",
        required=True,
        help="origin/relay URLs (several after one flag, repeated, or comma-separated)",
    )
    fetch.add_argument("--version", default="latest", help="version number or 'latest'")
    fetch.add_argument("--out", required=True, help="directory holding fetched versions")
    fetch.add_argument(
        "--publisher-key", required=True, help="trusted publisher key: hex or key file"
    )
    fetch.add_argument(
        "--allow-rollback", action="store_true", help="accept a version older than the one held"
    )
    _common_args(fetch)
    origin = sub.add_parser("serve-origin", help="serve a store directory over HTTP")
    origin.add_argument("--store", required=True)
    origin.add_argument("--host", default="127.0.0.1")
    origin.add_argument("--port", type=int, default=8470)
    _common_args(origin)
    return parser


def _shardcast(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    configure_logging("shardcast", args.log_level)
    cfg = config_from_args(args).shardcast

    if args.command == "publish":
        from swarmrl.identity import load_keypair
        from swarmrl.shardcast.publisher import Publisher

        publisher = Publisher(args.store, load_keypair(args.key), cfg)
        version = args.version if args.version is not None else (publisher.latest() or 0) + 1
        manifest = publisher.publish(args.checkpoint_dir, version, args.step)
        print(
            json.dumps(
                {
                    "version": manifest.version,
                    "shards": manifest.shard_count,
                    "bytes": manifest.total_bytes,
                    "deltas": [d.size for d in manifest.deltas],
                    "root_digest": manifest.root_digest,
                }
            )
        )
        return 0
    if args.command == "fetch":
        from swarmrl.shardcast.client import WeightClient

        sources = [s.strip() for item in args.source for s in item.split(",") if s.strip()]
        client = WeightClient(sources, parse_public_keys(args.publisher_key), args.out, cfg)
        version = args.version if args.version == "latest" else int(args.version)
        path = client.fetch(version, allow_rollback=args.allow_rollback)
        for report in client.reports:
            print(
                f"warning: {report.source} served corrupt {report.what} of v{report.version}: {report.reason}"
            )
        print(path)
        return 0
    from swarmrl.shardcast.catalog import Catalog
    from swarmrl.shardcast.server import build_app, serve_until_signal

    catalog = Catalog(args.store, cfg.keep_versions)
    catalog.refresh()
    return serve_until_signal(
        build_app(catalog, cfg, role="origin", watch_disk=True), args.host, args.port
    )


def main(verb: str, argv: Sequence[str]) -> int:
    return _shardcast(argv)
