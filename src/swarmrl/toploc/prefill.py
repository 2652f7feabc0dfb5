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

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from swarmrl.inference.types import Prefill, check_token_ids

Pair = tuple[Sequence[int], Sequence[int]]


class Replayer(Protocol):
    """What the verifier needs from an engine: one prefill of a fixed prompt + completion.

    Engines that also expose ``backbone``, ``fast_path``, ``pad_id`` and ``device`` (as
    ``TorchEngine`` does) are replayed in batches (:func:`prefill_many`).
    """

    def prefill(self, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> Prefill: ...


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


def _carriers(
    pairs: Sequence[Pair], ready: Sequence[int], shared: Sequence[Hashable | None]
) -> tuple[list[Pair], dict[int, tuple[int, int]]]:
    """The pairs that carry a group of ``shared`` pairs, and for each carried pair ``(carrier
    index, carrier's prompt length)``: the members whose sequence is a prefix of the group's
    longest (checked here, token by token); the others are replayed on their own."""
    members: dict[Hashable, list[int]] = {}
    for i in ready:
        if shared[i] is not None:
            members.setdefault(shared[i], []).append(i)
    carriers: list[Pair] = []
    plan: dict[int, tuple[int, int]] = {}
    for group in members.values():
        seqs = {i: list(pairs[i][0]) + list(pairs[i][1])[:-1] for i in group}
        full = max(seqs.values(), key=len)
        carried = [i for i in group if seqs[i] == full[: len(seqs[i])]]
        if len(carried) < 2:
            continue
        start = min(len(pairs[i][0]) for i in carried)
        plan.update({i: (len(carriers), start) for i in carried})
        carriers.append((full[:start], full[start:] + full[-1:]))  # the last token is not fed
    return carriers, plan


def prefill_many(
    engine: Any,
    pairs: Sequence[Pair],
    max_batch_tokens: int = 4096,
    shared: Sequence[Hashable | None] | None = None,
) -> list[Prefill | Exception]:
    """One :class:`Prefill` per (prompt, output), or the exception that sample raised.

    Invalid samples (empty, ids outside the vocabulary) fail alone; a batch whose forward
    fails is retried one sample at a time so one bad row cannot sink the others.

    ``shared``: pairs with the same key whose sequences extend one another (the model calls of
    one episode segment: each call's prompt holds the calls before it) are replayed by *one*
    prefill of the longest, each pair's rows sliced out of it. A causal model's states at a
    position depend on the tokens up to it only, so the slice is the pair's own prefill up to
    float rounding of the longer pass (what ``calibrate`` measures for batching). Pairs that
    do not extend one another are replayed each on its own.
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
    carriers, plan = _carriers(pairs, ready, shared) if shared is not None else ([], {})
    own = [i for i in ready if i not in plan]
    todo = [pairs[i] for i in own] + carriers
    replays: list[Prefill | Exception] = [ValueError("not replayed")] * len(todo)
    lengths = [len(p) + len(o) - 1 for p, o in todo]
    for group in _batches(lengths, max_batch_tokens):
        try:
            for g, prefill in zip(
                group, _prefill_batch(engine, [todo[g] for g in group]), strict=True
            ):
                replays[g] = prefill
        except (ValueError, IndexError, RuntimeError):
            for g in group:
                try:
                    replays[g] = engine.prefill(*todo[g])
                except (ValueError, IndexError, RuntimeError) as exc:
                    replays[g] = exc
    for j, i in enumerate(own):
        results[i] = replays[j]
    for i, (c, start) in plan.items():
        carried = replays[len(own) + c]
        if isinstance(carried, Exception):
            results[i] = carried
            continue
        p, n = len(pairs[i][0]), len(pairs[i][1])
        results[i] = Prefill(
            logits=carried.logits[p - start : p - start + n],  # [n, vocab]
            hidden_states=carried.hidden_states[: p + n - 1],  # [P + n - 1, hidden]
        )
    return results
