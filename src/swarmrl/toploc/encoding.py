"""Proof chunks: which hidden-state positions each chunk covers, and its 258-byte encoding.

A sample with P prompt tokens and n output tokens has final-norm hidden states at positions
0 .. P+n-2 (position P-1+j produced output token j). They are cut into chunks::

    chunk 0      positions 0 .. P-1                         (the prompt / prefill)
    chunk c >= 1 positions P + (c-1)*S .. min(P + c*S, P+n-1) - 1   (S = chunk_size decode steps)

so there are 1 + ceil((n-1) / S) chunks. For each chunk the states are rounded to bf16 and
flattened row-major ([positions, hidden] -> [positions * hidden]); the top-k entries by |value|
(``torch.topk`` on the bf16 magnitudes, as the reference library does) give indices x_j and
16-bit patterns y_j. With m the largest modulus <= 65497 (counting down) that keeps the x_j
distinct, the chunk is the polynomial through (x_j mod m, y_j) over GF(65497)
(``swarmrl.toploc.poly``), serialised big-endian::

    bytes 0..1           m                          (u16)
    bytes 2+2e..3+2e     coefficient of x^e, e = 0..k-1, each in [0, 65497)   (u16)

258 bytes for k = 128: byte-identical to ``ProofPoly.to_bytes()`` of ``toploc`` 0.1.6. A chunk
with fewer than k entries uses all of them and pads the coefficients with zeros (the same
polynomial), so every chunk has the same size.

Knows nothing about signatures, bundles or what a verifier accepts (see ``bundle``, ``verify``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from swarmrl.errors import BadProof
from swarmrl.toploc.poly import PRIME, injective_modulus, interpolate

Span = tuple[int, int]  # [start, end) hidden-state positions


def chunk_spans(prompt_len: int, output_len: int, chunk_size: int) -> list[Span]:
    """The [start, end) position range of every chunk (see the module docstring)."""
    if prompt_len < 1 or output_len < 1 or chunk_size < 1:
        raise ValueError("chunk_spans needs prompt_len, output_len, chunk_size >= 1")
    end = prompt_len + output_len - 1
    spans = [(0, prompt_len)]
    spans += [(s, min(s + chunk_size, end)) for s in range(prompt_len, end, chunk_size)]
    return spans


def chunk_count(prompt_len: int, output_len: int, chunk_size: int) -> int:
    """1 + ceil((n - 1) / S): how many chunks a well-formed bundle carries."""
    return 1 + math.ceil((output_len - 1) / chunk_size)


def chunk_bytes_len(topk: int) -> int:
    """Encoded size of one chunk: 2 bytes of modulus + 2 per coefficient (258 for k = 128)."""
    return 2 + 2 * topk


def bf16_patterns(values: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (nearest even) and return the 16-bit patterns as int64 in [0, 65536)."""
    return values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def chunk_topk(chunks: Sequence[torch.Tensor], topk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk ([positions, hidden] float), top-k by |bf16 value|: (indices, patterns) [k].

    Chunks of equal size are stacked and ranked in one ``torch.topk`` call; k is reduced to
    the chunk's size when it holds fewer than ``topk`` entries.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for position, chunk in enumerate(chunks):
        groups[chunk.numel()].append(position)
    out: list[tuple[np.ndarray, np.ndarray]] = [(np.empty(0), np.empty(0))] * len(chunks)
    for numel, members in groups.items():
        flat = torch.stack([chunks[i].reshape(-1) for i in members]).to(torch.bfloat16)  # [G, N]
        k = min(topk, numel)
        indices = torch.topk(flat.abs(), k, dim=-1).indices  # [G, k]
        patterns = flat.gather(-1, indices).view(torch.int16).to(torch.int64) & 0xFFFF
        idx_np, pat_np = indices.numpy(), patterns.numpy()
        for row, position in enumerate(members):
            out[position] = (idx_np[row], pat_np[row])
    return out


def encode_chunks(
    indices: Sequence[np.ndarray], patterns: Sequence[np.ndarray], topk: int
) -> list[bytes]:
    """Interpolate and serialise many chunks at once (one batched interpolation per size)."""
    out: list[bytes] = [b""] * len(indices)
    by_k: dict[int, list[int]] = defaultdict(list)
    for position, idx in enumerate(indices):
        by_k[len(idx)].append(position)
    for k, members in by_k.items():
        x = np.stack([indices[i] for i in members]).astype(np.int64)  # [G, k]
        y = np.stack([patterns[i] for i in members]).astype(np.int64)  # [G, k]
        moduli = injective_modulus(x)  # [G]
        coeffs = interpolate(x % moduli[:, None], y)  # [G, k]
        words = np.zeros((len(members), 1 + topk), dtype=">u2")
        words[:, 0] = moduli
        words[:, 1 : 1 + k] = coeffs
        for row, position in enumerate(members):
            out[position] = words[row].tobytes()
    return out


def build_chunk_proofs(
    hidden_states: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    chunk_size: int,
    topk: int,
) -> list[list[bytes]]:
    """Every sample's chunk proofs, all samples batched together.

    hidden_states: per sample [P + n - 1, hidden]; prompt_lens: per sample P.
    Returns per sample a list of ``chunk_count`` encoded chunks.
    """
    chunks: list[torch.Tensor] = []
    owners: list[int] = []
    for sample, (states, prompt_len) in enumerate(zip(hidden_states, prompt_lens, strict=True)):
        output_len = states.shape[0] - prompt_len + 1
        for start, end in chunk_spans(prompt_len, output_len, chunk_size):
            chunks.append(states[start:end])
            owners.append(sample)
    ranked = chunk_topk(chunks, topk)
    encoded = encode_chunks([r[0] for r in ranked], [r[1] for r in ranked], topk)
    proofs: list[list[bytes]] = [[] for _ in hidden_states]
    for sample, chunk in zip(owners, encoded, strict=True):
        proofs[sample].append(chunk)
    return proofs


def decode_chunks(chunks: Sequence[bytes], topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse encoded chunks into (moduli [C], coefficients [C, topk]); BadProof if malformed.

    Malformed: wrong length, modulus 0 (the reference library's null proof) or above p,
    or a coefficient outside [0, p).
    """
    size = chunk_bytes_len(topk)
    for position, chunk in enumerate(chunks):
        if len(chunk) != size:
            raise BadProof(f"chunk {position} is {len(chunk)} bytes, want {size}")
    if not chunks:
        return np.zeros(0, dtype=np.int64), np.zeros((0, topk), dtype=np.int64)
    words = np.frombuffer(b"".join(chunks), dtype=">u2").reshape(len(chunks), 1 + topk)
    words = words.astype(np.int64)
    moduli, coeffs = words[:, 0], words[:, 1:]
    bad = np.flatnonzero((moduli < 1) | (moduli > PRIME) | (coeffs >= PRIME).any(axis=1))
    if bad.size:
        raise BadProof(f"chunk {int(bad[0])} has a null modulus or out-of-field values")
    return moduli, coeffs
