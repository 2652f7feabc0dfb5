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


# RFC 8032, section 7.1, test 1 (an empty message)
RFC_SEED = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"
RFC_PUBLIC = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
RFC_SIGNATURE = (
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e3970"
    "1cf9b46bd25bf5f0595bbe24655141438e7a100b"
)
# the identity point (0, 1) and the point of order 2 (0, -1), as compressed ed25519 keys
IDENTITY = "01" + "00" * 31
ORDER_TWO = "ec" + "ff" * 30 + "7f"
# the group order L, little-endian: S + L is the same scalar, not the same encoding
GROUP_ORDER = 2**252 + 27742317777372353535851937790883648493


def test_signatures_match_rfc_8032():
    pair = KeyPair.from_seed(bytes.fromhex(RFC_SEED))
    assert pair.public_key_hex == RFC_PUBLIC
    assert pair.sign(b"") == RFC_SIGNATURE
    verify_signature(RFC_PUBLIC, b"", RFC_SIGNATURE)


@pytest.mark.parametrize("weak", [IDENTITY, ORDER_TWO])
def test_a_small_order_key_is_refused_though_its_signature_is_universal(weak):
    # R = identity, S = 0 satisfies the cofactorless equation [S]B = R + [h]A for every message
    # when A is the identity (and for half of them at order 2): a key nobody holds the secret of,
    # whose "signatures" anyone can make, so its owner could deny every request it sent
    universal = IDENTITY + "00" * 32
    for message in (b"join", b"a submission I will later deny"):
        with pytest.raises(BadSignature, match="small-order or off-curve"):
            verify_signature(weak, message, universal)


def test_a_malleated_signature_is_refused():
    # (R, S + L) passes the curve equation as (R, S) does; only the reduced S is a signature
    pair = KeyPair.generate()
    sig = bytes.fromhex(pair.sign(b"msg"))
    s = int.from_bytes(sig[32:], "little") + GROUP_ORDER
    malleated = sig[:32] + s.to_bytes(32, "little")
    with pytest.raises(BadSignature, match="does not verify"):
        verify_signature(pair.public_key_hex, b"msg", malleated.hex())
