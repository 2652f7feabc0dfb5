"""Ledger export files and their offline verification.

An export is JSON Lines: a header line ``{"entries": N, "format": "swarmrl-ledger-v1",
"last_hash": h}`` (every header field is checked against the entries, so no header byte can
change unnoticed either) then one canonical-JSON line per entry (the hashed part plus
``entry_hash`` and ``signature``), in sequence order. :func:`verify_export` re-derives every hash,
checks the chain and each ed25519 signature against the orchestrator key, insists each line is
byte-for-byte canonical (so no byte can change without notice), checks that every revealed
assignment secret hashes to its earlier commitment, re-derives every spot-check decision whose
secret is revealed (``swarmrl.ledger.spotchecks``), re-derives every node's evidence record from
the measurements its verdict entries carry and checks each verdict and ban against it
(``swarmrl.ledger.evidence``), and names the first bad entry.
It also sums per-node contributions. Knows nothing about databases (see ``swarmrl.ledger.cli``).

The chain alone cannot show a cut at the very end of a file (a shorter chain is still a valid
chain). So an export made through the orchestrator carries, in its header, the orchestrator's
signed ``attestation`` of the head it exported (entries, last hash, time): a file cut short, or
with a header rewritten to match, fails against it. An export written straight from a database
(``swarmrl ledger export --db``) has no attestation; the report says so (``attested``), and the
end of such a file is only as trustworthy as the copy it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.errors import BadSignature
from swarmrl.identity.keys import canonical_json, digest_hex, verify_signature
from swarmrl.ledger.chain import GENESIS_HASH, attestation_message, entry_core, entry_hash
from swarmrl.ledger.counts import LedgerCounts
from swarmrl.ledger.evidence import EvidenceReplay
from swarmrl.ledger.reputation import reputation
from swarmrl.ledger.spotchecks import SpotCheckReplay

EXPORT_FORMAT = "swarmrl-ledger-v1"


def export_lines(
    entries: list[dict[str, Any]], attestation: dict[str, Any] | None = None
) -> list[bytes]:
    """Canonical lines of an export (header first, with the orchestrator's ``attestation`` of
    this head when given), each without its newline."""
    last = entries[-1]["entry_hash"] if entries else GENESIS_HASH
    header: dict[str, Any] = {"format": EXPORT_FORMAT, "entries": len(entries), "last_hash": last}
    if attestation is not None:
        header["attestation"] = attestation
    return [canonical_json(header)] + [canonical_json(e) for e in entries]


@dataclass
class Contribution:
    """What the ledger says one node did."""

    credited_tokens: int = 0
    dropped_tokens: int = 0
    submissions: int = 0
    accepted: int = 0
    soft: int = 0
    hard: int = 0
    banned: bool = False

    @property
    def net_tokens(self) -> int:
        return self.credited_tokens - self.dropped_tokens

    @property
    def reputation(self) -> float:
        return reputation(self.accepted, self.soft, self.hard, self.banned)


@dataclass
class VerifyReport:
    ok: bool
    entries: int
    first_bad: str | None = None  # "header", or "entry <seq> (line <n>)"
    reason: str = ""
    last_hash: str = GENESIS_HASH
    contributions: dict[str, Contribution] = field(default_factory=dict)
    attested: bool = False  # the header's head is signed by the orchestrator (see module doc)
    spot_checks_verified: int = 0  # submission draws recomputed from revealed secrets
    spot_checks_unrevealed: int = 0  # draws whose epoch secret is not revealed yet
    counts: LedgerCounts = field(default_factory=LedgerCounts)  # swarmrl.ledger.counts
    evidence_verdicts: int = 0  # verdicts whose measurements the evidence records re-derive
    evidence_flagged: int = 0  # nodes the re-derived records flag (each banned, or not ok)


def _tally(contrib: dict[str, Contribution], entry: dict[str, Any]) -> None:
    node, kind, body = entry.get("node_id"), entry["kind"], entry["body"]
    if node is None:
        return
    c = contrib.setdefault(node, Contribution())
    if kind == "submission":
        c.submissions += 1
    elif kind == "credit":
        c.credited_tokens += int(body.get("tokens", 0))
    elif kind == "slash":
        c.dropped_tokens += int(body.get("dropped_tokens", 0))
    elif kind == "verdict" and body.get("accept"):
        c.accepted += 1
    elif kind == "invalidation":
        if body.get("severity") == "hard":
            c.hard += 1
            c.banned = True
        else:
            c.soft += 1


def _check_entry(
    raw: bytes, expected_seq: int, prev: str, orchestrator_key: str
) -> tuple[dict[str, Any] | None, str]:
    """Parse and check one line; returns (entry, "") or (None, reason)."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(entry, dict):
        return None, "not a JSON object"
    keys = {"seq", "ts", "kind", "pool_id", "node_id", "body", "prev_hash", "entry_hash"}
    if set(entry) != keys | {"signature"}:
        return None, f"fields {sorted(entry)} are not the ledger entry fields"
    if canonical_json(entry) != raw:
        return None, "line is not canonical JSON (bytes were altered)"
    if entry["seq"] != expected_seq:
        return None, f"sequence number {entry['seq']!r}, expected {expected_seq}"
    if entry["prev_hash"] != prev:
        return None, "prev_hash does not match the previous entry's hash (chain broken)"
    core = entry_core(
        *(entry[k] for k in ("seq", "ts", "kind", "pool_id", "node_id", "body")), prev
    )
    if entry_hash(core) != entry["entry_hash"]:
        return None, "entry_hash does not match the entry's content"
    try:
        verify_signature(orchestrator_key, str(entry["entry_hash"]).encode(), entry["signature"])
    except BadSignature as exc:
        return None, f"orchestrator signature invalid ({exc})"
    return entry, ""


def _check_assignment(commits: dict[tuple[Any, Any], str], entry: dict[str, Any]) -> str:
    """Reason an assignment entry is inconsistent with earlier ones, or "" (see
    ``swarmrl.pool.trust.assignments``: a revealed secret must hash to its earlier commitment)."""
    body = entry["body"]
    if not isinstance(body, dict):
        return ""
    where = (entry["pool_id"], body.get("epoch"))
    if entry["kind"] == "assignment_commit":
        if where in commits:
            return f"assignment epoch {where[1]} of pool {where[0]!r} committed twice"
        commits[where] = str(body.get("commitment"))
    elif entry["kind"] == "assignment_reveal":
        secret = str(body.get("secret"))
        if commits.get(where) != digest_hex(secret.encode()):
            return f"assignment secret of epoch {where[1]} does not match its commitment"
    return ""


class ChainCheck:
    """The entry-by-entry part of a verification, kept between calls: feed the entries of a
    ledger in sequence order as they come (``swarmrl.roles.orchestrator.dashboard`` checks a
    live ledger once and then only its new entries: chained entries never change).
    ``report`` is the verification so far; once an entry fails, every later feed is refused."""

    def __init__(self, orchestrator_key: str) -> None:
        self.orchestrator_key = orchestrator_key
        self.report = VerifyReport(True, 0)
        self._commits: dict[tuple[Any, Any], str] = {}
        self._spot = SpotCheckReplay()
        self._evidence = EvidenceReplay()

    def feed(self, raw: bytes, where: str = "") -> bool:
        """Check the next entry (its canonical line, without newline); False when it or an
        earlier one is bad. ``where`` locates the line in the report (" (line 7)")."""
        report = self.report
        if not report.ok:
            return False
        entry, reason = _check_entry(raw, report.entries, report.last_hash, self.orchestrator_key)
        if entry is not None:
            reason = (
                _check_assignment(self._commits, entry)
                or self._spot.feed(entry)
                or self._evidence.feed(entry)
            )
        if reason:
            report.ok, report.reason = False, reason
            report.first_bad = f"entry {report.entries}{where}"
            return False
        assert entry is not None
        _tally(report.contributions, entry)
        report.counts.add(entry)
        report.entries += 1
        report.last_hash = entry["entry_hash"]
        return True

    def finish(self) -> VerifyReport:
        """The report once every entry was fed: the spot checks' end-of-ledger rule applied."""
        report = self.report
        if not report.ok:
            return report
        reason = self._spot.finish()
        report.spot_checks_verified = self._spot.verified
        report.spot_checks_unrevealed = len(self._spot.unrevealed)
        if reason:
            report.ok, report.first_bad, report.reason = False, "spot checks", reason
            return report
        banned = {node for node, c in report.contributions.items() if c.banned}
        reason = self._evidence.finish(banned)
        report.evidence_verdicts = self._evidence.verdicts
        report.evidence_flagged = self._evidence.nodes_flagged()
        if reason:
            report.ok, report.first_bad, report.reason = False, "evidence", reason
        return report


def verify_lines(lines: list[bytes], orchestrator_key: str) -> VerifyReport:
    """Verify an export given as lines (without newlines); see the module docstring."""
    if not lines:
        return VerifyReport(False, 0, "header", "empty file")
    try:
        header = json.loads(lines[0])
    except (ValueError, UnicodeDecodeError) as exc:
        return VerifyReport(False, 0, "header", f"header is not JSON ({exc})")
    if not isinstance(header, dict) or canonical_json(header) != lines[0]:
        return VerifyReport(False, 0, "header", "header is not canonical JSON")
    if set(header) - {"attestation"} != {"format", "entries", "last_hash"}:
        return VerifyReport(False, 0, "header", f"header fields {sorted(header)} are not expected")
    if header["format"] != EXPORT_FORMAT:
        return VerifyReport(False, 0, "header", f"format {header['format']!r} unknown")
    check = ChainCheck(orchestrator_key)
    for line_no, raw in enumerate(lines[1:], start=2):
        if not check.feed(raw, f" (line {line_no})"):
            return check.report
    report = check.finish()
    if not report.ok:
        return report
    if header["entries"] != report.entries:
        report.ok, report.first_bad = False, "header"
        report.reason = f"header says {header['entries']!r} entries, file holds {report.entries}"
    elif header["last_hash"] != report.last_hash:
        report.ok, report.first_bad = False, "header"
        report.reason = "header last_hash differs from the last entry's hash"
    elif "attestation" in header:
        reason = _check_attestation(header["attestation"], report, orchestrator_key)
        report.ok, report.attested = not reason, not reason
        report.first_bad, report.reason = ("header", reason) if reason else (None, "")
    return report


def _check_attestation(att: Any, report: VerifyReport, orchestrator_key: str) -> str:
    """Why the header's attestation does not vouch for this file's head ("" when it does)."""
    if not isinstance(att, dict) or set(att) != {"entries", "last_hash", "at", "signature"}:
        return "attestation is not {entries, last_hash, at, signature}"
    try:
        message = attestation_message(att["entries"], att["last_hash"], att["at"])
        verify_signature(orchestrator_key, message, str(att["signature"]))
    except (BadSignature, TypeError, ValueError) as exc:
        return f"attestation is not signed by the orchestrator ({exc})"
    if (att["entries"], att["last_hash"]) != (report.entries, report.last_hash):
        return (
            f"the orchestrator attested {att['entries']} entries ending {att['last_hash'][:12]}…, "
            f"the file holds {report.entries}"
        )
    return ""


def verify_export(path: str | Path, orchestrator_key: str) -> VerifyReport:
    """Verify an export file; a missing final newline or stray bytes count as tampering."""
    data = Path(path).read_bytes()
    if not data.endswith(b"\n"):
        lines = data.split(b"\n")
        report = verify_lines(lines, orchestrator_key)
        if report.ok:
            report.ok, report.first_bad = False, f"entry {report.entries - 1} (line {len(lines)})"
            report.reason = "file does not end with a newline (bytes were altered)"
        return report
    return verify_lines(data[:-1].split(b"\n"), orchestrator_key)
