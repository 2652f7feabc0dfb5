"""``swarmrl ledger``: export a ledger from its database and verify an export offline.

``swarmrl ledger export --db URL --out FILE`` writes JSON Lines; ``swarmrl ledger verify FILE
--orchestrator-key HEX`` checks every hash, link and signature, names the first bad entry, and
prints per-node contributions. Exit status 0 = valid, 1 = tampered or invalid.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from swarmrl.errors import MissingPathError, UserError
from swarmrl.ledger.export import open_ledger_db, write_export
from swarmrl.ledger.verify import verify_export


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl ledger", description="the contribution ledger")
    sub = parser.add_subparsers(dest="action", required=True)
    exp = sub.add_parser("export", help="write the ledger of a database to a file")
    exp.add_argument("--db", required=True, help="SQLAlchemy URL, e.g. sqlite:///run/pool.db")
    exp.add_argument("--out", required=True, help="export file (JSON Lines)")
    ver = sub.add_parser("verify", help="check an export offline")
    ver.add_argument("file")
    ver.add_argument("--orchestrator-key", required=True, help="orchestrator public key, hex")
    return parser


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    console = Console(width=max(Console().width, 160))
    if args.action == "export":
        count = write_export(open_ledger_db(args.db), args.out)
        console.print(f"exported {count} ledger entries to {args.out}")
        return 0
    key = args.orchestrator_key.strip().lower()
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise UserError("--orchestrator-key must be the 64-hex-character public key")
    try:
        report = verify_export(args.file, key)
    except OSError as exc:
        raise MissingPathError(f"cannot read ledger export {args.file}: {exc}") from exc
    table = Table(title="contributions per node")
    for column in (
        "node",
        "taken in",
        "checked",
        "accepted",
        "rejected",
        "invalidated",
        "soft",
        "hard",
        "credited",
        "dropped",
        "net tokens",
        "reputation",
    ):
        table.add_column(column, justify="left" if column == "node" else "right")
    for node, c in sorted(report.contributions.items(), key=lambda kv: -kv[1].net_tokens):
        table.add_row(
            node + (" (banned)" if c.banned else ""),
            *(
                str(getattr(report.counts.node(node), word))
                for word in ("taken_in", "checked", "accepted", "rejected", "invalidated")
            ),
            str(c.soft),
            str(c.hard),
            str(c.credited_tokens),
            str(c.dropped_tokens),
            str(c.net_tokens),
            f"{c.reputation:.2f}",
        )
    console.print(table)
    console.print(
        f"submissions (the words: docs/observability.md): {report.counts.total.text()}",
        soft_wrap=True,
    )
    if report.ok:
        console.print(
            f"OK: {report.entries} entries, chain and signatures valid; "
            f"last hash {report.last_hash}; "
            + (
                "head attested by the orchestrator"
                if report.attested
                else "head not attested (an export from a database: a cut at its end would not "
                "show; compare the last hash with the orchestrator's /ledger/attestation)"
            )
        )
        console.print(
            f"spot checks: {report.spot_checks_verified} selections re-derived from revealed "
            f"secrets, {report.spot_checks_unrevealed} await their epoch's reveal"
        )
        console.print(
            f"evidence: {report.evidence_verdicts} verdicts' measurements re-derive every node's "
            f"record; {report.evidence_flagged} nodes flagged by it, each banned"
        )
        return 0
    console.print(
        f"INVALID: first bad {report.first_bad}: {report.reason} "
        f"({report.entries} entries before it are valid)"
    )
    return 1
