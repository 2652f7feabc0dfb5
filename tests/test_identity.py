import json
import os

import pytest

from swarmrl.errors import BadSignature, MissingPathError, UserError
from swarmrl.identity import KeyPair, load_keypair, node_id_for, verify_signature


def test_sign_and_verify_roundtrip():
    pair = KeyPair.generate()
    sig = pair.sign(b"hello")
    verify_signature(pair.public_key_hex, b"hello", sig)
    with pytest.raises(BadSignature):
        verify_signature(pair.public_key_hex, b"hellO", sig)


def test_forged_and_malformed_signatures_are_rejected():
    pair, other = KeyPair.generate(), KeyPair.generate()
    sig = other.sign(b"msg")
    with pytest.raises(BadSignature):
        verify_signature(pair.public_key_hex, b"msg", sig)
    with pytest.raises(BadSignature):
        verify_signature(pair.public_key_hex, b"msg", "zz")
    with pytest.raises(BadSignature):
        verify_signature(pair.public_key_hex, b"msg", sig[:-2])
    with pytest.raises(BadSignature):
        verify_signature("00" * 31, b"msg", sig)


def test_node_id_derives_from_public_key():
    pair = KeyPair.from_seed(bytes(32))
    assert pair.node_id == node_id_for(pair.public_key_hex)
    assert len(pair.node_id) == 32
    assert KeyPair.from_seed(bytes(32)).node_id == pair.node_id
    assert KeyPair.from_seed(bytes([1] * 32)).node_id != pair.node_id


def test_key_file_roundtrip_and_errors(tmp_path):
    path = tmp_path / "k.json"
    pair = KeyPair.generate()
    pair.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_keypair(path).node_id == pair.node_id
    with pytest.raises(UserError, match="already exists"):
        pair.save(path)
    with pytest.raises(MissingPathError):
        load_keypair(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kind": "ed25519", "private_key": "xyz"}))
    with pytest.raises(UserError, match="not a swarmrl ed25519 key file"):
        load_keypair(broken)
