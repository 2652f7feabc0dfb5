"""Batched validator replays: many (prompt, output) prefills in few forward passes.

A validator checks samples from many workers at once; one prefill per sample wastes the
batching the worker enjoyed while generating. ``prefill_many`` packs sequences (sorted by
length, at most ``max_batch_tokens`` padded positions per pass) into left-padded batches and
runs the engine's backbone once per batch, with the same masks and rotary positions the
engine uses for generation. Engines without a backbone use their own ``prefill_many`` (vLLM
batches in its scheduler) and fall back to ``engine.prefill`` one sample at a time.

Per row the result equals ``engine.prefill`` up to float rounding of batched kernels (what
``calibrate`` measures). Knows nothing about proofs or verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmrl.inference.types import Prefill, check_token_ids

Pair = tuple[Sequence[int], Sequence[int]]


def _batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that rows x longest length stays within the budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def _prefill_batch(engine: Any, pairs: Sequence[Pair]) -> list[Prefill]:
    backbone = engine.backbone
    device = engine.device
    seqs = [list(p) + list(o)[:-1] for p, o in pairs]
    batch, width = len(seqs), max(len(s) for s in seqs)
    lens = torch.tensor([len(s) for s in seqs], device=device)  # [B]
    tokens = torch.full((batch, width), engine.pad_id, dtype=torch.long)
    for b, seq in enumerate(seqs):
        tokens[b, width - len(seq) :] = torch.tensor(seq)
    key_valid = torch.arange(width, device=device)[None] >= (width - lens)[:, None]  # [B, W]
    positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, W]
    cache = None if engine.fast_path else backbone.new_cache(batch, width)
    hidden, logits = backbone.forward(
        tokens.to(device), positions, key_valid, cache, 0, "all"
    )  # [B, W, hidden], [B, W, vocab]
    out = []
    for b, (prompt, _) in enumerate(pairs):
        start = width - len(seqs[b])
        out.append(
            Prefill(
                logits=logits[b, start + len(prompt) - 1 :].float().cpu(),  # [n, vocab]
                hidden_states=hidden[b, start:].float().cpu(),  # [P + n - 1, hidden]
            )
        )
    return out


def prefill_many(
    engine: Any, pairs: Sequence[Pair], max_batch_tokens: int = 4096
) -> list[Prefill | Exception]:
    """One :class:`Prefill` per (prompt, output), or the exception that sample raised.

    Invalid samples (empty, ids outside the vocabulary) fail alone; a batch whose forward
    fails is retried one sample at a time so one bad row cannot sink the others.
    """
    results: list[Prefill | Exception] = [ValueError("not replayed")] * len(pairs)
    if not hasattr(engine, "backbone") and hasattr(engine, "prefill_many"):
        try:  # an engine that batches by itself (vLLM); one bad pair sends all to the loop below
            return list(engine.prefill_many(pairs))
        except (ValueError, IndexError, RuntimeError):
            pass
    if not hasattr(engine, "backbone"):
        for i, (prompt, output) in enumerate(pairs):
            try:
                results[i] = engine.prefill(prompt, output)
            except (ValueError, IndexError, RuntimeError) as exc:
                results[i] = exc
        return results
    vocab = engine.backbone.vocab_size
    ready: list[int] = []
    for i, (prompt, output) in enumerate(pairs):
        try:
            check_token_ids(prompt, vocab, "prompt")
            check_token_ids(output, vocab, "output")
            if not prompt or not output:
                raise ValueError("prefill needs at least one prompt and one output token")
            ready.append(i)
        except ValueError as exc:
            results[i] = exc
    lengths = [len(pairs[i][0]) + len(pairs[i][1]) - 1 for i in ready]
    for group in _batches(lengths, max_batch_tokens):
        members = [ready[g] for g in group]
        try:
            for i, prefill in zip(
                members, _prefill_batch(engine, [pairs[i] for i in members]), strict=True
            ):
                results[i] = prefill
        except (ValueError, IndexError, RuntimeError):
            for i in members:
                try:
                    results[i] = engine.prefill(*pairs[i])
                except (ValueError, IndexError, RuntimeError) as exc:
                    results[i] = exc
    return results
