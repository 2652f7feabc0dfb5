"""``swarmrl relay``: follow upstreams, verify every shard against the signed manifest, serve.

    swarmrl relay --upstream URL[,URL…] --publisher-key KEY --store DIR [--host H] [--port P]

Imports neither torch nor transformers: a relay installs and starts light.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from swarmrl.identity.keys import parse_public_keys
from swarmrl.shardcast.cli import add_shardcast_args, shardcast_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl relay", description="run a weight relay following upstreams"
    )
    parser.add_argument("--upstream", required=True, help="URL[,URL…] of origins or relays")
    parser.add_argument(
        "--publisher-key", required=True, help="trusted publisher key: hex or key file"
    )
    parser.add_argument(
        "--store", required=True, help="directory for the versions this relay holds"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8471)
    add_shardcast_args(parser)
    return parser


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from swarmrl.shardcast.catalog import Catalog
    from swarmrl.shardcast.relay import Follower
    from swarmrl.shardcast.server import build_app, serve_until_signal

    cfg = shardcast_config(args)
    catalog = Catalog(args.store, cfg.keep_versions)
    upstreams = [u.strip() for u in args.upstream.split(",") if u.strip()]
    follower = Follower(upstreams, parse_public_keys(args.publisher_key), catalog, cfg)
    app = build_app(catalog, cfg, role="relay")
    follower.start()
    return serve_until_signal(app, args.host, args.port, on_stop=follower.stop)
