"""Polynomials over GF(65497), batched: interpolation, evaluation, and the injective modulus.

A proof chunk commits to k points (x_j, y_j) with the unique polynomial P of degree < k over the
prime field GF(p), p = 65497, such that P(x_j) = y_j (mod p). Here x_j are top-k indices
already reduced by the chunk's modulus m (so distinct and < p) and y_j are 16-bit bf16
patterns (a pattern >= p is a NaN, so reducing mod p loses no finite value).

Interpolation is Newton's divided differences followed by a Horner expansion into ascending
monomial coefficients c_0..c_{k-1} (the order the reference ``toploc`` library stores)::

    d_j^(0) = y_j
    d_j^(s) = (d_j^(s-1) - d_{j-1}^(s-1)) / (x_j - x_{j-s})      for s = 1..k-1, j >= s
    P(x)    = d_0 + (x - x_0)(d_1 + (x - x_1)(d_2 + ... (x - x_{k-2}) d_{k-1}))

with d_j = d_j^(j). Evaluation is Horner's rule on the monomial form. Every operation is on
whole arrays [chunks, k]: the Python-level loops run over the k - 1 difference orders and the
k - 1 Horner steps, never over chunks, samples or individual coefficients, so the Python cost
of a batch is fixed (~2k array steps) however many chunks it holds. (A loop-free closed form
through the inverse Vandermonde matrix exists but needs [chunks, k, k] power tables and
measured 2-6x slower on CPU.)

Arithmetic is numpy int64: residues are < 2^16, so a product of two is < 2^32.

This module knows nothing about hidden states, chunks or bytes (see ``encoding``).
"""

from __future__ import annotations

from functools import cache

import numpy as np

PRIME = 65497
"""The field modulus; also the largest (first tried) chunk modulus m."""

_BLOCK = 32  # candidate moduli tested at once by :func:`injective_modulus`


@cache
def inverse_table() -> np.ndarray:
    """inv[a] = a^(p-2) mod p for a in [0, p) (Fermat; inv[0] = 0).  [p] int64"""
    result = np.ones(PRIME, dtype=np.int64)
    base = np.arange(PRIME, dtype=np.int64)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    result.setflags(write=False)
    return result


@cache
def _inverse_of_difference() -> np.ndarray:
    """inv[(a mod p)] indexed by a + p for a in (-p, p): differences need no reduction."""
    table = np.concatenate([inverse_table(), inverse_table()])
    table.setflags(write=False)
    return table


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Ascending coefficients of the polynomial through (x_j, y_j) over GF(p), per row.

    x: [B, k] residues distinct within each row; y: [B, k] integers (reduced mod p here).
    Returns [B, k] int64 in [0, p).
    """
    inv = _inverse_of_difference()
    x = np.asarray(x, dtype=np.int64) % PRIME
    diffs = np.asarray(y, dtype=np.int64) % PRIME  # becomes the Newton coefficients d_j
    batch, k = x.shape
    for s in range(1, k):
        numerator = diffs[:, s:] - diffs[:, s - 1 : -1] + PRIME  # [B, k-s] in (0, 2p)
        denominator = x[:, s:] - x[:, :-s] + PRIME  # [B, k-s] in (0, 2p), never p
        diffs[:, s:] = numerator * inv[denominator] % PRIME
    # Horner: c <- c * (x - x_i) + d_i, i = k-2 .. 0, with c starting as d_{k-1}
    coeffs = np.zeros((batch, k), dtype=np.int64)  # ascending
    coeffs[:, 0] = diffs[:, k - 1]
    minus_x = PRIME - x  # [B, k]
    for i in range(k - 2, -1, -1):
        degree = k - 1 - i  # degree after this step
        lead = coeffs[:, degree - 1].copy()
        step = coeffs[:, :degree] * minus_x[:, i : i + 1]  # -x_i * c_j, < 2^32
        step[:, 1:] += coeffs[:, : degree - 1]  # + c_{j-1}
        step[:, 0] += diffs[:, i]
        coeffs[:, :degree] = step % PRIME
        coeffs[:, degree] = lead
    return coeffs


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(x) mod p for each row's polynomial at that row's points (Horner).

    coeffs: [B, k] ascending; x: [B, n] non-negative integers. Returns [B, n] int64 in [0, p).
    """
    coeffs = np.asarray(coeffs, dtype=np.int64) % PRIME
    x = np.asarray(x, dtype=np.int64) % PRIME
    value = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)  # [B, n]
    for e in range(coeffs.shape[1] - 2, -1, -1):
        value = (value * x + coeffs[:, e : e + 1]) % PRIME
    return value


def injective_modulus(indices: np.ndarray) -> np.ndarray:
    """Per row, the largest m <= p, counting down from p, with the row's indices distinct mod m.

    indices: [B, k] distinct non-negative integers per row. Returns [B] int64. Rows whose
    indices are all below p take m = p at once; the others test candidates in blocks.
    """
    indices = np.asarray(indices, dtype=np.int64)
    result = np.full(indices.shape[0], PRIME, dtype=np.int64)
    pending = np.flatnonzero(indices.max(axis=-1, initial=0) >= PRIME)
    top = PRIME
    while pending.size and top > 0:
        candidates = np.arange(top, max(top - _BLOCK, 0), -1, dtype=np.int64)  # descending
        residues = np.sort(indices[pending, None, :] % candidates[None, :, None], axis=-1)
        distinct = (residues[..., 1:] != residues[..., :-1]).all(axis=-1)  # [b, K]
        found = distinct.any(axis=-1)
        result[pending[found]] = candidates[distinct[found].argmax(axis=-1)]
        pending = pending[~found]
        top -= _BLOCK
    if pending.size:
        raise ValueError("no injective modulus: indices repeat within a row")
    return result
