"""The hidden-state check: a validator's replayed states against a prover's chunk polynomials.

For each chunk the validator takes its own top-k indices i (by |bf16 value|, same rule as the
prover), evaluates the prover's polynomial at i mod m (m = the prover's committed modulus;
skipping this reduction is wrong whenever some index is >= m) and compares patterns with
``swarmrl.toploc.stats``. All chunks of all samples are evaluated in one batched call.

Knows nothing about signatures, sampling or what the thresholds are (see ``verify``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swarmrl.toploc.encoding import chunk_spans, chunk_topk
from swarmrl.toploc.poly import evaluate
from swarmrl.toploc.stats import chunk_statistics


@dataclass(frozen=True)
class ChunkAgreement:
    """Statistics of one chunk: ``k`` compared entries (fewer than top-k for tiny chunks)."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    k: int


def compare_chunks(
    hidden_states: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    moduli: Sequence[np.ndarray],
    coeffs: Sequence[np.ndarray],
    chunk_size: int,
    topk: int,
) -> list[list[ChunkAgreement]]:
    """Per sample, per chunk agreement between replayed states and the committed chunks.

    hidden_states: per sample [P + n - 1, hidden] (validator's replay); moduli: per sample
    [C]; coeffs: per sample [C, topk]. C must equal the sample's chunk count (checked by the
    caller). Returns per sample a list of C :class:`ChunkAgreement`.
    """
    chunks: list[torch.Tensor] = []
    for states, prompt_len in zip(hidden_states, prompt_lens, strict=True):
        output_len = states.shape[0] - prompt_len + 1
        chunks += [states[s:e] for s, e in chunk_spans(prompt_len, output_len, chunk_size)]
    if not chunks:
        return [[] for _ in hidden_states]
    ranked = chunk_topk(chunks, topk)
    total = len(chunks)
    points = np.zeros((total, topk), dtype=np.int64)
    ours = np.zeros((total, topk), dtype=np.int64)
    valid = np.zeros((total, topk), dtype=bool)
    for row, (idx, pat) in enumerate(ranked):
        points[row, : len(idx)], ours[row, : len(idx)], valid[row, : len(idx)] = idx, pat, True
    all_moduli = np.concatenate([np.asarray(m, dtype=np.int64) for m in moduli])  # [total]
    all_coeffs = np.concatenate([np.asarray(c, dtype=np.int64) for c in coeffs])  # [total, k]
    theirs = evaluate(all_coeffs, points % all_moduli[:, None])  # [total, topk]
    mismatches, means, medians = chunk_statistics(theirs, ours, valid)
    counts = valid.sum(axis=1)
    out: list[list[ChunkAgreement]] = []
    row = 0
    for m in moduli:
        out.append(
            [
                ChunkAgreement(
                    int(mismatches[r]), float(means[r]), float(medians[r]), int(counts[r])
                )
                for r in range(row, row + len(m))
            ]
        )
        row += len(m)
    return out
