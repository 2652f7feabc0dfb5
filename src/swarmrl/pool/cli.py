"""``swarmrl pool``: pool administration (invites, pool creation); the service is a role.

    swarmrl pool invite --key owner.json --pool ID [--expires-in 86400] [--node NODE_ID] [--out F]
    swarmrl pool create --url URL --key orch.json --spec spec.json
    swarmrl pool spec CONFIG --owner KEY [--validator KEY …] [--out pool.json]

Knows only argument parsing; the work is in ``swarmrl.pool.server`` and the client.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from swarmrl.errors import MissingPathError, UserError
from swarmrl.identity.keys import load_keypair
from swarmrl.pool.spec_check import add_spec_args, refusal, spec_main
from swarmrl.protocol.pool import PoolSpec


def read_spec(path: str) -> PoolSpec:
    file = Path(path)
    if not file.is_file():
        raise MissingPathError(f"pool spec not found: {path}")
    try:
        return PoolSpec.model_validate_json(file.read_text())
    except ValidationError as exc:
        raise refusal(path, exc) from exc


def _pool(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="swarmrl pool", description="pool administration")
    sub = parser.add_subparsers(dest="action", required=True)
    inv = sub.add_parser("invite", help="sign a single-use invite offline with the owner key")
    inv.add_argument("--key", required=True, help="pool owner key file")
    inv.add_argument("--pool", required=True, help="pool id")
    inv.add_argument("--expires-in", type=float, default=86400.0, help="seconds of validity")
    inv.add_argument("--node", default=None, help="only this node id may use it")
    inv.add_argument("--out", default=None, help="write the invite JSON here (else stdout)")
    create = sub.add_parser("create", help="create a pool on a running orchestrator")
    create.add_argument("--url", required=True)
    create.add_argument("--key", required=True, help="orchestrator key file")
    create.add_argument("--spec", required=True, help="pool spec JSON")
    add_spec_args(sub.add_parser("spec", help="write the pool spec a config implies"))
    args = parser.parse_args(list(argv))
    if args.action == "spec":
        return spec_main(args)
    if args.action == "invite":
        from swarmrl.pool.invites import make_invite

        if args.expires_in <= 0:
            raise UserError("--expires-in must be positive")
        invite = make_invite(load_keypair(args.key), args.pool, args.expires_in, args.node)
        text = invite.model_dump_json(indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
            print(f"invite {invite.invite_id} to pool {args.pool} written to {args.out}")
        else:
            print(text)
        return 0
    from swarmrl.pool.client import PoolClient

    with PoolClient(args.url, load_keypair(args.key)) as client:
        info = client.create_pool(read_spec(args.spec))
    print(json.dumps(info.model_dump(mode="json"), indent=2))
    return 0


def main(verb: str, argv: Sequence[str]) -> int:
    return _pool(argv)
