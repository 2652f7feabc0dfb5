"""``swarmrl orchestrator``: run the pool service (pools, nodes, leases, submissions, ledger).

    swarmrl orchestrator --key orch.json [--db URL] [--store DIR|URL] [--run-dir DIR]
                         [--host 127.0.0.1] [--port 8600] [--pool spec.json …] [--set k=v …]

Process wiring only; the service is :mod:`swarmrl.pool`. Imports neither torch nor
transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from swarmrl.config.load import parse_override
from swarmrl.config.pool import PoolConfig
from swarmrl.errors import ConfigError
from swarmrl.identity.keys import load_keypair
from swarmrl.pool.cli import read_spec


def main(verb: str, argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="swarmrl orchestrator", description="run the pool service"
    )
    parser.add_argument("--key", required=True, help="orchestrator key file (signs the ledger)")
    parser.add_argument("--db", default="", help="SQLAlchemy URL (default: SQLite in --run-dir)")
    parser.add_argument("--store", default="", help="rollout dir or fsspec URL (default: run dir)")
    parser.add_argument("--run-dir", default="runs/orchestrator", help="default db/store home")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8600, help="0 = any free port")
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    parser.add_argument("--pool", action="append", default=[], help="pool spec JSON to host")
    parser.add_argument("--set", action="append", default=[], help="pool config key=value")
    args = parser.parse_args(list(argv))
    overrides: dict[str, object] = {}
    for item in args.set:
        overrides.update(parse_override(item))
    try:
        config = PoolConfig(**{**overrides, "db_url": args.db, "store_url": args.store})
    except ValidationError as exc:
        raise ConfigError(f"pool config: {exc.errors()[0]['msg']}") from exc
    from swarmrl.pool import service
    from swarmrl.pool.rejections import Conflict
    from swarmrl.pool.server import make_context, serve_forever

    ctx = make_context(load_keypair(args.key), args.run_dir, config)
    for path in args.pool:
        spec = read_spec(path)
        try:
            service.create_pool(ctx, spec)
        except Conflict:  # already hosted (a restart): its state comes back from the database
            if service.get_pool(ctx, spec.pool_id).spec != spec:
                print(
                    f"swarmrl orchestrator: warning: pool {spec.pool_id!r} already exists with "
                    f"a different spec than {path}; keeping the stored one",
                    file=sys.stderr,
                )
    serve_forever(ctx, args.host, args.port, args.port_file)
    return 0
