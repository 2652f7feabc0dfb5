"""``swarmrl validator``: the trusted checker of a pool.

    swarmrl validator [CONFIG] --key validator.key --orchestrator URL --pool ID
                      --weights URL [--weights URL …] --publisher-key KEY [--work-dir DIR]

Loop: claim pending submissions, fetch each declared policy version through shardcast (the
last few stay loaded), judge (``swarmrl.roles.validator.judge``), post the signed verdict. The
validator's key must be listed in the pool's ``validators``. Knows nothing about training.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from swarmrl.rolekit.toolkit import add_peer_args, add_role_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl validator",
        description="run a trusted validator: claim submissions, replay them, post verdicts",
    )
    add_role_args(parser)
    add_peer_args(parser)
    parser.add_argument(
        "--work-dir", default=None, help="weights cache (default: ./validator-NAME)"
    )
    parser.add_argument(
        "--claim", type=int, default=4, help="submissions claimed at once (judged together)"
    )
    return parser


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    # the heavy imports (torch, transformers) come after parsing: ``--help`` answers at once
    from swarmrl.roles.validator.process import start

    return start(args)
