"""``swarmrl keys``: make and inspect ed25519 key files.

``swarmrl keys new --out FILE`` writes a fresh key (mode 0600, never overwriting);
``swarmrl keys show FILE`` prints its public key and node id. Knows nothing about pools.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from swarmrl.identity.keys import KeyPair, load_keypair


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl keys", description="ed25519 key files")
    sub = parser.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="write a fresh key file")
    new.add_argument("--out", required=True, help="key file to create (refuses to overwrite)")
    show = sub.add_parser("show", help="print the public key and node id of a key file")
    show.add_argument("file")
    return parser


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.action == "new":
        pair = KeyPair.generate()
        pair.save(args.out)
    else:
        pair = load_keypair(args.file)
    print(f"public_key {pair.public_key_hex}")
    print(f"node_id    {pair.node_id}")
    return 0
