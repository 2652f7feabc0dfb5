"""ed25519 key pairs, node ids, and signatures over bytes.

A key file is JSON: ``{"kind": "ed25519", "private_key": "<64 hex>", "public_key": "<64 hex>"}``
written with mode 0600. A node id is ``sha256(public key bytes)`` in hex, cut to 32 characters
(128 bits), so anyone holding the public key can recompute it and nobody can choose it.
Signatures are 64 raw bytes, carried as hex on the wire.

Signing and verification are libsodium's (PyNaCl), which verifies a short message in about
half the time of OpenSSL's ed25519 and refuses what proves nothing: a public key of small order
(or off the curve) and a signature whose R has small order or whose S is not reduced. Under
the identity point as public key, R = identity and S = 0 "sign" every message; a verifier
that accepts that lets a member pick a key whose signatures anyone can make, and later deny
every submission it sent. Such a key is refused with that reason (:func:`key_is_usable`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.bindings
from nacl.exceptions import BadSignatureError, CryptoError

from swarmrl.errors import BadSignature, MissingPathError, UserError

NODE_ID_HEX_CHARS = 32


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace, UTF-8) for hashing and signing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest_hex(data: bytes) -> str:
    """SHA-256 of ``data`` as 64 hex characters."""
    return hashlib.sha256(data).hexdigest()


def node_id_for(public_key_hex: str) -> str:
    """The node id derived from a public key (hex): first 128 bits of its SHA-256, in hex."""
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError as exc:
        raise BadSignature(f"public key is not hex: {public_key_hex[:20]!r}") from exc
    if len(raw) != 32:
        raise BadSignature(f"public key must be 32 bytes, got {len(raw)}")
    return hashlib.sha256(raw).hexdigest()[:NODE_ID_HEX_CHARS]


@dataclass(frozen=True)
class PublicKey:
    """A peer's ed25519 public key; verifies signatures made by its private half."""

    hex: str

    @property
    def node_id(self) -> str:
        return node_id_for(self.hex)

    def verify(self, message: bytes, signature_hex: str) -> None:
        """Raise :class:`BadSignature` unless ``signature_hex`` signs ``message``."""
        verify_signature(self.hex, message, signature_hex)


def verify_signature(public_key_hex: str, message: bytes, signature_hex: str) -> None:
    """Raise :class:`BadSignature` unless ``signature_hex`` is a valid ed25519 signature.

    Malformed hex, wrong lengths and forged signatures all raise the same error type, so
    callers have one thing to catch and record.
    """
    try:
        key_bytes = bytes.fromhex(public_key_hex)
        sig_bytes = bytes.fromhex(signature_hex)
    except (ValueError, TypeError) as exc:
        raise BadSignature("public key or signature is not hex") from exc
    if len(key_bytes) != 32 or len(sig_bytes) != 64:
        raise BadSignature(
            f"bad lengths: public key {len(key_bytes)} bytes (want 32), "
            f"signature {len(sig_bytes)} bytes (want 64)"
        )
    try:
        nacl.bindings.crypto_sign_open(sig_bytes + message, key_bytes)
    except BadSignatureError as exc:
        if not key_is_usable(key_bytes):
            raise BadSignature(
                "public key is not a usable ed25519 key (a small-order or off-curve point: "
                "signatures under it prove nothing)"
            ) from exc
        raise BadSignature("signature does not verify") from exc


def key_is_usable(key_bytes: bytes) -> bool:
    """Whether 32 bytes are an ed25519 public key that signatures can bind to: on the curve
    and not of small order (libsodium's conversion to X25519 refuses exactly those)."""
    try:
        nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(key_bytes)
    except (CryptoError, RuntimeError, ValueError, TypeError):  # libsodium's refusal
        return False
    return True


class KeyPair:
    """An ed25519 private key (its 32-byte seed) with its public half and node id."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
        self._seed = bytes(seed)
        raw_public, self._secret = nacl.bindings.crypto_sign_seed_keypair(self._seed)
        self.public = PublicKey(raw_public.hex())

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(os.urandom(32))

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        """Deterministic key from a 32-byte seed (tests and reproducible local swarms only)."""
        return cls(seed)

    @property
    def public_key_hex(self) -> str:
        return self.public.hex

    @property
    def node_id(self) -> str:
        return self.public.node_id

    def sign(self, message: bytes) -> str:
        """Signature over ``message`` as 128 hex characters."""
        signed = nacl.bindings.crypto_sign(message, self._secret)  # signature, then message
        return signed[: nacl.bindings.crypto_sign_BYTES].hex()

    def save(self, path: str | Path) -> None:
        """Write the key file (JSON, mode 0600). Refuses to overwrite an existing file."""
        path = Path(path)
        if path.exists():
            raise UserError(f"key file already exists, not overwriting: {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        private_hex = self._seed.hex()
        body = json.dumps(
            {"kind": "ed25519", "private_key": private_hex, "public_key": self.public.hex},
            indent=2,
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(body + "\n")


def load_keypair(path: str | Path) -> KeyPair:
    """Read a key file written by :meth:`KeyPair.save`; one-line errors for bad files."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"key file not found: {path}")
    try:
        data = json.loads(path.read_text())
        pair = KeyPair(bytes.fromhex(data["private_key"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"key file {path} is not a swarmrl ed25519 key file ({exc})") from exc
    if data.get("public_key") not in (None, pair.public.hex):
        raise UserError(f"key file {path}: public_key does not match private_key")
    return pair


def _is_hex_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def parse_public_key(value: str) -> str:
    """A public key (lower-case hex) from 64 hex characters or a key file.

    A key file is either a swarmrl key file (its ``public_key``) or a file holding the bare
    64-hex public key. Raises a one-line :class:`UserError` for anything else.
    """
    text = value.strip()
    if _is_hex_key(text):
        return text.lower()
    path = Path(text)
    if not path.is_file():
        raise MissingPathError(f"public key is neither 64 hex characters nor a key file: {value}")
    body = path.read_text().strip()
    if _is_hex_key(body):
        return body.lower()
    try:
        key = str(json.loads(body)["public_key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a swarmrl key file nor a 64-hex public key") from exc
    if not _is_hex_key(key):
        raise UserError(f"{path}: public_key is not 64 hex characters")
    return key.lower()


def parse_public_keys(value: str) -> list[str]:
    """Several public keys, comma-separated, each as :func:`parse_public_key` reads it."""
    keys = [parse_public_key(item) for item in value.split(",") if item.strip()]
    if not keys:
        raise UserError("no public key given")
    return keys
