"""Node identities: ed25519 key pairs, node ids, and signing of bytes and canonical JSON.

Knows nothing about HTTP or pools; request signing (method, path, body digest, timestamp,
nonce) builds on these helpers in ``swarmrl.identity.requests``.
"""

from swarmrl.identity.keys import (
    KeyPair,
    PublicKey,
    canonical_json,
    digest_hex,
    load_keypair,
    node_id_for,
    parse_public_key,
    parse_public_keys,
    verify_signature,
)

__all__ = [
    "KeyPair",
    "PublicKey",
    "canonical_json",
    "digest_hex",
    "load_keypair",
    "node_id_for",
    "parse_public_key",
    "parse_public_keys",
    "verify_signature",
]
