"""Request signing and verification without a server: what is signed, windows, nonces, sizes."""

import hashlib
import time

import pytest

from swarmrl.cli import main as swarmrl_main
from swarmrl.errors import BadSignature, ReplayedRequest
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.identity.requests import (
    MemoryNonceStore,
    OversizedRequest,
    RequestVerifier,
    request_message,
    sign_request,
)

NOW = 1_800_000_000.0


def verifier(window_s=30.0, max_body_bytes=1000):
    return RequestVerifier(MemoryNonceStore(), window_s=window_s, max_body_bytes=max_body_bytes)


def test_signature_covers_method_path_body_timestamp_and_nonce():
    key = KeyPair.from_seed(bytes(range(32)))
    h = sign_request(key, "post", "/pools/a/lease?x=1", b"{}", now_s=NOW, nonce="ab" * 8)
    assert h["X-Swarm-Timestamp"] == str(int(NOW * 1000))
    message = request_message(
        "POST",
        "/pools/a/lease?x=1",
        hashlib.sha256(b"{}").hexdigest(),
        int(NOW * 1000),
        "ab" * 8,
    )
    assert message.startswith(b"swarmrl-request-v1\nPOST\n/pools/a/lease?x=1\n")
    signed = verifier().verify("POST", "/pools/a/lease?x=1", b"{}", h, now_s=NOW)
    assert signed.node_id == key.node_id and signed.nonce == "ab" * 8
    for method, path, body in [
        ("GET", "/pools/a/lease?x=1", b"{}"),
        ("POST", "/pools/a/lease?x=2", b"{}"),
        ("POST", "/pools/a/lease?x=1", b"{ }"),
    ]:
        with pytest.raises(BadSignature, match="does not verify"):
            verifier().verify(method, path, body, h, now_s=NOW)
    for header, value in [
        ("X-Swarm-Timestamp", str(int(NOW * 1000) + 1)),
        ("X-Swarm-Nonce", "cd" * 8),
        ("X-Swarm-Key", KeyPair.generate().public_key_hex),
    ]:
        with pytest.raises(BadSignature):
            verifier().verify("POST", "/pools/a/lease?x=1", b"{}", h | {header: value}, now_s=NOW)


def test_window_nonce_reuse_and_expiry():
    key, v = KeyPair.generate(), verifier(window_s=30)
    h = sign_request(key, "GET", "/x", now_s=NOW, nonce="0" * 32)
    with pytest.raises(ReplayedRequest, match="window"):
        v.verify("GET", "/x", b"", h, now_s=NOW + 31)
    with pytest.raises(ReplayedRequest, match="window"):
        v.verify("GET", "/x", b"", h, now_s=NOW - 31)
    store = MemoryNonceStore()
    assert store.claim(key.public_key_hex, "n" * 16, expires_at_s=2e12)
    assert not store.claim(key.public_key_hex, "n" * 16, expires_at_s=2e12)
    assert store.claim(KeyPair.generate().public_key_hex, "n" * 16, expires_at_s=2e12)  # per key
    assert store.claim(key.public_key_hex, "m" * 16, expires_at_s=1.0)  # already expired …
    assert store.claim(
        key.public_key_hex, "m" * 16, expires_at_s=1.0
    )  # … so it can be claimed again


def test_replay_refused_and_forged_requests_claim_no_nonce():
    key, v = KeyPair.generate(), verifier()
    h = sign_request(key, "POST", "/y", b"1")
    forged = dict(h, **{"X-Swarm-Signature": KeyPair.generate().sign(b"x")})
    with pytest.raises(BadSignature):
        v.verify("POST", "/y", b"1", forged)
    v.verify("POST", "/y", b"1", h)  # the forgery did not burn the nonce
    with pytest.raises(ReplayedRequest, match="already used"):
        v.verify("POST", "/y", b"1", h, now_s=time.time())


def test_malformed_headers_and_oversized_bodies():
    key, v = KeyPair.generate(), verifier(max_body_bytes=10)
    h = sign_request(key, "POST", "/z", b"0123456789")
    v.verify("POST", "/z", b"0123456789", h)
    with pytest.raises(OversizedRequest, match="limit of 10"):
        v.verify("POST", "/z", b"0123456789a", sign_request(key, "POST", "/z", b"0123456789a"))
    for header, value, words in [
        ("X-Swarm-Key", "zz", "64 lowercase hex"),
        ("X-Swarm-Timestamp", "-5", "milliseconds"),
        ("X-Swarm-Nonce", "short", "16-64"),
        ("X-Swarm-Signature", "00", "bad lengths"),
    ]:
        with pytest.raises(BadSignature, match=words):
            v.verify("POST", "/z", b"", sign_request(key, "POST", "/z") | {header: value})
    with pytest.raises(BadSignature, match="missing header X-Swarm-Nonce"):
        v.verify("POST", "/z", b"", {k: x for k, x in h.items() if k != "X-Swarm-Nonce"})


def test_keys_cli_writes_a_loadable_key(tmp_path, capsys):
    out = tmp_path / "node.json"
    assert swarmrl_main(["keys", "new", "--out", str(out)]) == 0
    key = load_keypair(out)
    assert key.node_id in capsys.readouterr().out
    assert swarmrl_main(["keys", "new", "--out", str(out)]) == 2  # never overwrites
    assert swarmrl_main(["keys", "show", str(out)]) == 0
    assert key.public_key_hex in capsys.readouterr().out
