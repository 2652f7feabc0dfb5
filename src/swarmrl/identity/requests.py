"""Signed HTTP requests: the client signs, the server verifies, nonces are single-use.

A request is signed over one canonical message::

    swarmrl-request-v1 \\n METHOD \\n PATH?QUERY \\n sha256(body) hex \\n timestamp_ms \\n nonce

and carries four headers: ``X-Swarm-Key`` (ed25519 public key, 64 hex), ``X-Swarm-Timestamp``
(Unix milliseconds, decimal), ``X-Swarm-Nonce`` (16–64 lowercase hex) and ``X-Swarm-Signature``
(128 hex). The server accepts a request only if the signature verifies, the timestamp is at most
``window_s`` old and at most ``max_future_s`` ahead of its own clock (a few seconds of skew: a
request dated further ahead could be held back and replayed later), the body is at most
``max_body_bytes``, and the (key, nonce) pair was never seen before. A nonce is remembered until
its timestamp leaves the window, after which the window check alone refuses a replay, so the
nonce store stays bounded. A server that restarts must keep its nonces across the restart (the
orchestrator keeps them in its database, ``swarmrl.pool.state.nonces``), or a request captured before
the restart replays after it.

Knows nothing about HTTP frameworks, pools or databases: the nonce store is a small protocol
with an in-memory implementation here.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from swarmrl.errors import BadSignature, OversizedRequest, ReplayedRequest
from swarmrl.identity.keys import KeyPair, PublicKey, digest_hex, node_id_for, verify_signature

HEADER_KEY = "X-Swarm-Key"
HEADER_TIMESTAMP = "X-Swarm-Timestamp"
HEADER_NONCE = "X-Swarm-Nonce"
HEADER_SIGNATURE = "X-Swarm-Signature"
SIGNED_HEADERS = (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)

_NONCE_RE = re.compile(r"^[0-9a-f]{16,64}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
_DIGITS_RE = re.compile(r"^[0-9]{1,16}$")


def request_message(
    method: str, path: str, body_digest: str, timestamp_ms: int, nonce: str
) -> bytes:
    """The exact bytes a request signature covers (``path`` includes ``?query`` if any)."""
    return "\n".join(
        ["swarmrl-request-v1", method.upper(), path, body_digest, str(timestamp_ms), nonce]
    ).encode()


def sign_request(
    keypair: KeyPair,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    now_s: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """Headers that authenticate ``method path body`` as sent by ``keypair`` now."""
    timestamp_ms = int((time.time() if now_s is None else now_s) * 1000)
    nonce = nonce or secrets.token_hex(16)
    message = request_message(method, path, digest_hex(body), timestamp_ms, nonce)
    return {
        HEADER_KEY: keypair.public_key_hex,
        HEADER_TIMESTAMP: str(timestamp_ms),
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: keypair.sign(message),
    }


@dataclass(frozen=True)
class SignedRequest:
    """What the server learned from a request that verified."""

    public_key: PublicKey
    node_id: str
    timestamp_ms: int
    nonce: str
    signature: str
    body_digest: str
    body: bytes = field(default=b"", repr=False)  # the signed body, for whoever must keep it
    nonce_expires_at: float = 0.0  # Unix s: until when the nonce must be remembered
    # False: verified with ``claim=False``; the caller must claim the nonce before acting
    nonce_claimed: bool = True


class NonceStore(Protocol):
    """Remembers (key, nonce) pairs until they expire."""

    def claim(self, public_key_hex: str, nonce: str, expires_at_s: float) -> bool:
        """Record the pair; False if it was already recorded and has not expired."""
        ...


class MemoryNonceStore:
    """A thread-safe in-memory :class:`NonceStore` that forgets pairs after they expire."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._next_purge_s = 0.0

    def claim(self, public_key_hex: str, nonce: str, expires_at_s: float) -> bool:
        now = time.time()
        with self._lock:
            if now >= self._next_purge_s:
                self._seen = {k: t for k, t in self._seen.items() if t > now}
                self._next_purge_s = now + 10.0
            key = (public_key_hex, nonce)
            if self._seen.get(key, 0.0) > now:
                return False
            self._seen[key] = expires_at_s
            return True


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name) or headers.get(name.lower())
    if not value:
        raise BadSignature(f"missing header {name}")
    return value


class RequestVerifier:
    """Checks signature, time window, body size and nonce freshness of one request."""

    def __init__(
        self,
        nonce_store: NonceStore,
        *,
        window_s: float,
        max_body_bytes: int,
        max_future_s: float | None = None,
    ) -> None:
        """``max_future_s``: accepted clock skew ahead of ours; None = ``window_s``."""
        self.nonce_store = nonce_store
        self.window_s = window_s
        self.max_future_s = window_s if max_future_s is None else min(max_future_s, window_s)
        self.max_body_bytes = max_body_bytes

    def verify(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        now_s: float | None = None,
        claim: bool = True,
        signature_checked: bool = False,
    ) -> SignedRequest:
        """Return who signed the request, or raise a :class:`PeerError` saying what is wrong.

        The nonce is claimed only after every other check passes, so a forged or stale request
        leaves nothing behind. ``claim=False``: every check but the nonce's; the caller claims
        the nonce itself (in the transaction that acts on the request, saving one) before it
        acts, and refuses the request if the claim fails. ``signature_checked``: a process of
        ours already verified this very request's signature (an orchestrator's front,
        ``swarmrl.pool.web.bridge``); every other check is made as always.
        """
        if len(body) > self.max_body_bytes:
            raise OversizedRequest(
                f"body of {len(body)} bytes exceeds the limit of {self.max_body_bytes}"
            )
        key_hex = _header(headers, HEADER_KEY).lower()
        ts_text = _header(headers, HEADER_TIMESTAMP)
        nonce = _header(headers, HEADER_NONCE)
        signature = _header(headers, HEADER_SIGNATURE).lower()
        if not _HEX64_RE.match(key_hex):
            raise BadSignature(f"{HEADER_KEY} must be 64 lowercase hex characters")
        if not _DIGITS_RE.match(ts_text):
            raise BadSignature(f"{HEADER_TIMESTAMP} must be Unix milliseconds")
        if not _NONCE_RE.match(nonce):
            raise BadSignature(f"{HEADER_NONCE} must be 16-64 lowercase hex characters")
        timestamp_ms = int(ts_text)
        body_digest = digest_hex(body)
        message = request_message(method, path, body_digest, timestamp_ms, nonce)
        if not signature_checked:
            verify_signature(key_hex, message, signature)
        now = time.time() if now_s is None else now_s
        age_s = now - timestamp_ms / 1000.0
        if age_s > self.window_s or -age_s > self.max_future_s:
            raise ReplayedRequest(
                f"timestamp is {-age_s:+.1f} s from server time; the window is "
                f"−{self.window_s:g} s … +{self.max_future_s:g} s"
            )
        expires_at = timestamp_ms / 1000.0 + self.window_s
        if claim and not self.nonce_store.claim(key_hex, nonce, expires_at):
            raise replayed(nonce)
        return SignedRequest(
            public_key=PublicKey(key_hex),
            node_id=node_id_for(key_hex),
            timestamp_ms=timestamp_ms,
            nonce=nonce,
            signature=signature,
            body_digest=body_digest,
            body=body,
            nonce_expires_at=expires_at,
            nonce_claimed=claim,
        )


def replayed(nonce: str) -> ReplayedRequest:
    """The refusal of a request whose nonce this key already used."""
    return ReplayedRequest(f"nonce {nonce} was already used by this key")
