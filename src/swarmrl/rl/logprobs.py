"""Per-token log-probs (and entropy) of a causal LM, computed in chunks over the sequence.

For input ids x[0..T-1] and temperature τ, position j gives the log-prob of the next token::

    logp[j] = log_softmax(W·h_j / τ)[x_{j+1}]         j = 0 .. T-2
    H[j]    = −Σ_v p_v log p_v,   p = softmax(W·h_j / τ)   (a metric: computed without grad)

where h_j is the final-norm hidden state and W the LM head. The LM head, the log-softmax and
the gather run on ``chunk`` positions at a time, and under autograd each chunk is recomputed in
the backward pass (activation checkpointing), so [tokens × vocab] logits never exist for the
whole sequence at once, neither forward nor backward.

Assumes an HF decoder whose ``base_model`` returns the final-norm hidden states and whose
output embedding is a plain linear head (no logit soft-capping). Knows nothing about losses.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, temperature: float
) -> torch.Tensor:
    # hidden [B, C, H], targets [B, C], weight [V, H] -> [B, C]
    logits = (hidden @ weight.T).float() / temperature  # [B, C, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunk_entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (hidden @ weight.T).float() / temperature  # [B, C, V]
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)  # [B, C]


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp [B, T-1], entropy [B, T-1] | None)`` for ``input_ids`` ``[B, T]``.

    Sequences are right-padded (pads after the real tokens), so positions count from 0 and
    causal attention keeps pads from touching real positions; the caller masks pad positions.
    """
    # The model's own forward (one position of logits only), not its base model's: a sharded
    # model (FSDP2) gathers its outermost parameters, the LM head's included, in that forward.
    out = model(input_ids=input_ids, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1]  # [B, T-1, H], after the final norm
    targets = input_ids[:, 1:]  # [B, T-1]
    weight = model.get_output_embeddings().weight  # [V, H]
    pieces, entropies = [], []
    for start in range(0, hidden.shape[1], chunk):
        h = hidden[:, start : start + chunk]
        y = targets[:, start : start + chunk]
        if torch.is_grad_enabled():
            piece = checkpoint(_chunk_logprobs, h, y, weight, temperature, use_reentrant=False)
        else:
            piece = _chunk_logprobs(h, y, weight, temperature)
        pieces.append(piece)
        if with_entropy:
            with torch.no_grad():
                entropies.append(_chunk_entropy(h.detach(), weight.detach(), temperature))
    logp = torch.cat(pieces, dim=1)
    return logp, (torch.cat(entropies, dim=1) if with_entropy else None)
