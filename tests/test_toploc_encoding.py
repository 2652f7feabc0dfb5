"""Proof-chunk maths and bytes: hand-computed cases, the mod-m reduction, reference equality."""

import importlib.util
import random

import numpy as np
import pytest
import torch

from swarmrl.errors import BadProof
from swarmrl.toploc.encoding import (
    build_chunk_proofs,
    chunk_count,
    chunk_spans,
    decode_chunks,
    encode_chunks,
)
from swarmrl.toploc.hidden import compare_chunks
from swarmrl.toploc.poly import PRIME, evaluate, injective_modulus, interpolate
from swarmrl.toploc.stats import chunk_statistics


def _lagrange(xs, ys):
    """Slow scalar Lagrange interpolation over GF(p), ascending coefficients."""
    k = len(xs)
    out = [0] * k
    for j in range(k):
        basis, denom = [1], 1
        for t in range(k):
            if t != j:
                basis = [
                    ((basis[i - 1] if i else 0) - xs[t] * (basis[i] if i < len(basis) else 0))
                    % PRIME
                    for i in range(len(basis) + 1)
                ]
                denom = denom * (xs[j] - xs[t]) % PRIME
        scale = ys[j] * pow(denom, PRIME - 2, PRIME) % PRIME
        out = [(o + scale * b) % PRIME for o, b in zip(out, basis, strict=True)]
    return out


def test_interpolation_hand_cases():
    assert interpolate(np.array([[0, 1]]), np.array([[5, 7]])).tolist() == [[5, 2]]
    assert interpolate(np.array([[1, 2, 3]]), np.array([[1, 4, 9]])).tolist() == [[0, 0, 1]]
    # 7 - 2x: the slope is -2 = p - 2 in the field
    assert interpolate(np.array([[0, 1]]), np.array([[7, 5]])).tolist() == [[7, PRIME - 2]]
    # y is reduced mod p: a pattern >= p (a bf16 NaN) wraps
    assert interpolate(np.array([[0]]), np.array([[PRIME + 3]])).tolist() == [[3]]
    # evaluation reduces x mod p and uses ascending order
    assert evaluate(np.array([[5, 2]]), np.array([[0, 10, PRIME + 1]])).tolist() == [[5, 25, 7]]


def test_interpolation_matches_scalar_lagrange_batched():
    rng = random.Random(3)
    for k in (1, 2, 5, 17, 128):
        xs = [rng.sample(range(PRIME), k) for _ in range(4)]
        ys = [[rng.randrange(65536) for _ in range(k)] for _ in range(4)]
        got = interpolate(np.array(xs), np.array(ys))
        assert got.tolist() == [_lagrange(x, y) for x, y in zip(xs, ys, strict=True)]
        assert (evaluate(got, np.array(xs)) == np.array(ys) % PRIME).all()


def test_injective_modulus_counts_down_from_p():
    assert injective_modulus(np.array([[0, 5, 9]])).tolist() == [PRIME]
    # 1 and 1 + p collide mod p; mod p - 1 they are 1 and 2
    assert injective_modulus(np.array([[1, 1 + PRIME]])).tolist() == [PRIME - 1]
    # collide mod p and mod p - 1 (2 apart after two steps): 0 and lcm-free pair
    x = np.array([[0, PRIME * (PRIME - 1)]])
    assert injective_modulus(x).tolist() == [PRIME - 2]


def test_chunk_layout():
    assert chunk_spans(5, 1, 32) == [(0, 5)]
    assert chunk_spans(5, 2, 32) == [(0, 5), (5, 6)]
    assert chunk_spans(3, 70, 32) == [(0, 3), (3, 35), (35, 67), (67, 72)]
    assert chunk_count(3, 70, 32) == 4 == len(chunk_spans(3, 70, 32))
    assert chunk_count(3, 33, 32) == 2


def test_encoded_chunk_hand_case():
    # one position, hidden 4: top-2 by |v| are index 1 (-3.0 = 0xC040) and 2 (2.0 = 0x4000)
    states = torch.tensor([[0.5, -3.0, 2.0, 0.25]])
    (chunk,) = build_chunk_proofs([states], [1], chunk_size=32, topk=2)[0]
    # line through (1, 0xC040) and (2, 0x4000): slope 16384 - 49216 = -32832 = 32665 (mod p),
    # intercept 49216 - 32665 = 16551 = 0x40A7
    assert chunk == bytes.fromhex("FFD940A77F99")
    moduli, coeffs = decode_chunks([chunk], 2)
    assert moduli.tolist() == [PRIME] and coeffs.tolist() == [[16551, 32665]]


def test_chunks_are_258_bytes_and_small_chunks_pad():
    states = torch.randn(40, 8)  # prompt 10 -> 1 + ceil(30 / 32) = 2 chunks; 2nd is 30 x 8
    chunks = build_chunk_proofs([states], [10], 32, 128)[0]
    assert [len(c) for c in chunks] == [258, 258]
    tiny = build_chunk_proofs([torch.randn(2, 8)], [2], 32, 128)[0]  # 16 entries < 128
    moduli, coeffs = decode_chunks(tiny, 128)
    assert (coeffs[0, 16:] == 0).all()


def test_decode_rejects_malformed_chunks():
    good = build_chunk_proofs([torch.randn(4, 64)], [4], 32, 128)[0][0]
    with pytest.raises(BadProof, match="bytes"):
        decode_chunks([good[:-2]], 128)
    with pytest.raises(BadProof, match="null modulus"):
        decode_chunks([b"\x00\x00" + good[2:]], 128)  # the reference library's null proof
    with pytest.raises(BadProof, match="out-of-field"):
        decode_chunks([good[:2] + b"\xff\xff" + good[4:]], 128)


def test_statistics_hand_case():
    prover = np.array([[0x3F80, 0x3F85, 0x4000, 0x3F81]])
    mine = np.array([[0x3F80, 0x3F80, 0x3F80, 0x3F83]])
    mism, mean, median = chunk_statistics(prover, mine, np.ones((1, 4), bool))
    # exponents: 0x4000 differs; mantissa errors of the rest: 0, 5, 2 -> mean 7/3, median 2
    assert mism.tolist() == [1] and mean[0] == pytest.approx(7 / 3) and median.tolist() == [2.0]
    mism, mean, median = chunk_statistics(
        np.array([[0x4000]]), np.array([[0x3F80]]), np.ones((1, 1), bool)
    )
    assert mism.tolist() == [1] and np.isinf(mean[0]) and np.isinf(median[0])


def test_verification_reduces_indices_mod_m():
    """A chunk whose top indices collide mod p gets m < p; evaluation must use i mod m."""
    hidden = 128
    positions = (2 * PRIME) // hidden + 2  # flattened chunk longer than 2p
    states = torch.randn(positions, hidden) * 0.01
    flat = states.view(-1)
    planted = [7 + j * 977 for j in range(126)] + [5, 5 + PRIME]  # 5 and 5 + p collide mod p
    flat[torch.tensor(planted)] = torch.linspace(50, 100, len(planted))
    (chunk,) = build_chunk_proofs([states], [positions], 32, 128)[0]
    moduli, coeffs = decode_chunks([chunk], 128)
    assert moduli[0] < PRIME
    ((agreement,),) = compare_chunks([states], [positions], [moduli], [coeffs], 32, 128)
    assert agreement.exp_mismatches == 0 and agreement.mant_err_mean == 0.0
    # the reference Python path's mistake: evaluating at the raw index
    idx = torch.topk(flat.to(torch.bfloat16).abs(), 128).indices.numpy()
    want = (
        flat.to(torch.bfloat16)[torch.from_numpy(idx)].view(torch.int16).numpy().astype(np.int64)
        & 0xFFFF
    )
    raw = evaluate(coeffs, idx[None])[0]
    assert (raw != want).sum() > 0
    assert (evaluate(coeffs, (idx % moduli[0])[None])[0] == want).all()


def test_encode_is_batched_consistently():
    states = [torch.randn(9 + i, 32) for i in range(6)]
    together = build_chunk_proofs(states, [3] * 6, 4, 128)
    alone = [build_chunk_proofs([s], [3], 4, 128)[0] for s in states]
    assert together == alone
    idx = [np.array([3, 1, 2]), np.array([9, 4, 0])]
    pats = [np.array([10, 20, 30]), np.array([1, 2, 3])]
    for chunk, x, y in zip(encode_chunks(idx, pats, 3), idx, pats, strict=True):
        m, c = decode_chunks([chunk], 3)
        assert (evaluate(c, (x % m[0])[None]) == y).all()


@pytest.mark.skipif(
    importlib.util.find_spec("toploc") is None,
    reason="reference `toploc` package not installed "
    "(pip install --no-build-isolation --no-binary toploc toploc==0.1.6)",
)
def test_bytes_equal_reference_toploc():
    from toploc import build_proofs_bytes

    gen = torch.Generator().manual_seed(11)
    cases = [(6, 40, 128), (17, 3, 64), (3, 70, 256), (2, 33, 4096), (40, 9, 2048)]
    for prompt_len, output_len, hidden in cases:
        states = torch.randn(prompt_len + output_len - 1, hidden, generator=gen) * 2
        ours = build_chunk_proofs([states], [prompt_len], 32, 128)[0]
        bf16 = states.to(torch.bfloat16)
        activations = [bf16[:prompt_len]] + [
            bf16[prompt_len + i : prompt_len + i + 1] for i in range(output_len - 1)
        ]
        assert build_proofs_bytes(activations, 32, 128) == ours
