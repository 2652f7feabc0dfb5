"""The ledger: chained, signed entries; export; offline verification that catches any byte."""

import json

import pytest

from swarmrl.cli import main as swarmrl_main
from swarmrl.identity import KeyPair
from swarmrl.ledger.chain import GENESIS_HASH, Ledger
from swarmrl.ledger.export import read_entries, write_export
from swarmrl.ledger.reputation import reputation
from swarmrl.ledger.verify import verify_export, verify_lines
from swarmrl.pool.state.db import make_engine, sqlite_url


@pytest.fixture
def ledger_db(tmp_path):
    key = KeyPair.generate()
    engine = make_engine(sqlite_url(tmp_path / "l.db"))
    ledger = Ledger(key)
    a, b = "a" * 32, "b" * 32
    with engine.begin() as conn:
        ledger.append(conn, "pool_created", {"spec": {"pool_id": "p"}}, pool_id="p")
        ledger.append(conn, "node_joined", {"public_key": "00"}, pool_id="p", node_id=a)
        ledger.append(conn, "node_joined", {"public_key": "11"}, pool_id="p", node_id=b)
        ledger.append(
            conn, "submission", {"submission_id": "s1", "note": "é ünïcode"}, pool_id="p", node_id=a
        )
        ledger.append(
            conn, "verdict", {"submission_id": "s1", "accept": True}, pool_id="p", node_id=a
        )
        ledger.append(
            conn, "credit", {"submission_id": "s1", "tokens": 120}, pool_id="p", node_id=a
        )
        ledger.append(conn, "submission", {"submission_id": "s2"}, pool_id="p", node_id=b)
        ledger.append(conn, "credit", {"submission_id": "s2", "tokens": 30}, pool_id="p", node_id=b)
        ledger.append(
            conn,
            "invalidation",
            {"severity": "hard", "reason": "forged proof"},
            pool_id="p",
            node_id=b,
        )
        ledger.append(conn, "slash", {"dropped_tokens": 30}, pool_id="p", node_id=b)
    out = tmp_path / "ledger.jsonl"
    assert write_export(engine, out) == 10
    return key, engine, out


def test_entries_chain_and_export_verifies(ledger_db):
    key, engine, out = ledger_db
    entries = read_entries(engine)
    assert [e["seq"] for e in entries] == list(range(10))
    assert entries[0]["prev_hash"] == GENESIS_HASH
    assert all(
        e["prev_hash"] == p["entry_hash"] for p, e in zip(entries[:-1], entries[1:], strict=True)
    )
    report = verify_export(out, key.public_key_hex)
    assert report.ok and report.entries == 10 and report.last_hash == entries[-1]["entry_hash"]
    a, b = report.contributions["a" * 32], report.contributions["b" * 32]
    assert (a.net_tokens, a.accepted, a.banned) == (120, 1, False)
    assert (b.credited_tokens, b.dropped_tokens, b.net_tokens, b.banned) == (30, 30, 0, True)
    assert b.reputation == 0.0 and a.reputation == reputation(1, 0, 0, False) == 2 / 3


def test_wrong_orchestrator_key_fails_at_first_entry(ledger_db):
    _, _, out = ledger_db
    report = verify_export(out, KeyPair.generate().public_key_hex)
    assert not report.ok and report.first_bad == "entry 0 (line 2)" and "signature" in report.reason


def _entry_of(data: bytes, pos: int) -> int:
    """The entry whose line holds byte ``pos`` (−1 = header)."""
    return data[:pos].count(b"\n") - 1


def test_every_single_byte_change_is_detected_and_located(tmp_path):
    key = KeyPair.generate()
    engine = make_engine(sqlite_url(tmp_path / "small.db"))
    with engine.begin() as conn:
        for kind, body in [
            ("pool_created", {"spec": {}}),
            ("submission", {"note": "é ü"}),
            ("credit", {"tokens": 7}),
        ]:
            Ledger(key).append(conn, kind, body, pool_id="p", node_id="a" * 32)
    out = tmp_path / "small.jsonl"
    write_export(engine, out)
    data = out.read_bytes()
    for pos in range(len(data)):
        for replacement in {data[pos] ^ 0x01, ord("\n") if data[pos] != ord("\n") else ord(" ")}:
            tampered = bytearray(data)
            tampered[pos] = replacement
            lines = bytes(tampered)
            report = (
                verify_lines(lines[:-1].split(b"\n"), key.public_key_hex)
                if lines.endswith(b"\n")
                else None
            )
            if report is None:  # the final newline itself was changed
                path = out.with_name("t.jsonl")
                path.write_bytes(lines)
                report = verify_export(path, key.public_key_hex)
                assert not report.ok
                continue
            assert not report.ok, f"byte {pos} → {replacement} went unnoticed"
            where = _entry_of(data, pos)
            if where >= 0:
                # the first bad entry is the altered one (or, for a newline split, that one)
                assert report.first_bad.startswith(f"entry {where} "), (pos, report.first_bad)
            else:
                assert report.first_bad in ("header", "entry 0 (line 2)"), report.first_bad


def test_dropped_reordered_or_inserted_entries_are_detected(ledger_db):
    key, _, out = ledger_db
    header, *lines = out.read_bytes()[:-1].split(b"\n")
    dropped = verify_lines([header] + lines[:3] + lines[4:], key.public_key_hex)
    assert dropped.first_bad == "entry 3 (line 5)" and "sequence" in dropped.reason
    swapped = verify_lines(
        [header] + lines[:2] + [lines[3], lines[2]] + lines[4:], key.public_key_hex
    )
    assert swapped.first_bad == "entry 2 (line 4)"
    cut = verify_lines([header] + lines[:-1], key.public_key_hex)
    assert cut.first_bad == "header" and "9" in cut.reason


def test_ledger_cli_export_and_verify(ledger_db, tmp_path, capsys):
    key, engine, _ = ledger_db
    url = str(engine.url)
    out = tmp_path / "cli.jsonl"
    assert swarmrl_main(["ledger", "export", "--db", url, "--out", str(out)]) == 0
    assert (
        swarmrl_main(["ledger", "verify", str(out), "--orchestrator-key", key.public_key_hex]) == 0
    )
    text = capsys.readouterr().out
    assert "OK: 10 entries" in text and "a" * 32 in text and "120" in text
    lines = out.read_bytes().split(b"\n")
    entry = json.loads(lines[6])
    entry["body"]["tokens"] = 12000  # inflate a credit
    lines[6] = json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    out.write_bytes(b"\n".join(lines))
    assert (
        swarmrl_main(["ledger", "verify", str(out), "--orchestrator-key", key.public_key_hex]) == 1
    )
    text = capsys.readouterr().out
    assert "INVALID: first bad entry 5 (line 7): entry_hash does not match" in text


def test_an_attested_export_cut_short_is_detected(ledger_db, tmp_path):
    """The chain alone cannot show a cut at the end; the orchestrator's signed head can: a file
    cut short (header rewritten to match) fails, as do a forged or foreign attestation."""
    from swarmrl.identity.keys import canonical_json
    from swarmrl.ledger.chain import attest
    from swarmrl.ledger.export import write_entries
    from swarmrl.ledger.verify import export_lines

    key, engine, plain = ledger_db
    entries = read_entries(engine)
    head = attest(key, len(entries), entries[-1]["entry_hash"])
    full = tmp_path / "attested.jsonl"
    write_entries(entries, full, head)
    report = verify_export(full, key.public_key_hex)
    assert report.ok and report.attested
    assert not verify_export(plain, key.public_key_hex).attested  # straight from the database

    cut = export_lines(entries[:-2], head)  # the tail removed, the header counts rewritten
    report = verify_lines(cut, key.public_key_hex)
    assert not report.ok and report.first_bad == "header" and "attested 10 entries" in report.reason
    assert verify_lines(export_lines(entries[:-2]), key.public_key_hex).ok  # unattested: unseen

    forged = attest(KeyPair.generate(), len(entries), entries[-1]["entry_hash"])
    report = verify_lines(export_lines(entries, forged), key.public_key_hex)
    assert not report.ok and "not signed by the orchestrator" in report.reason
    bent = {**head, "at": head["at"] + 1}
    assert not verify_lines(export_lines(entries, bent), key.public_key_hex).ok
    lines = export_lines(entries, head)
    header = json.loads(lines[0])
    header["attestation"] = "yes"
    assert not verify_lines([canonical_json(header), *lines[1:]], key.public_key_hex).ok
