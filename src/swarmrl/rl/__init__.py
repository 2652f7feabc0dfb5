"""swarmrl.rl: the pure maths of learning — group advantages, the importance ratio and the
two-sided clipped loss, the rest of the loss family (Dr. GRPO, DAPO, GSPO, CISPO, the
trust-region mask) and their normalisers, off-policy corrections, k1/k3/squared KL, chunked
log-probs, filters and gradient clipping. Each module states its formula in its docstring.
"""

from swarmrl.rl.advantages import group_advantages
from swarmrl.rl.correction import correction_weights, mismatch_kl
from swarmrl.rl.filters import fill_with_informative, is_informative, pass_rate_mask
from swarmrl.rl.kl import k3_kl, kl_penalty
from swarmrl.rl.logprobs import token_logprobs
from swarmrl.rl.loss import clipped_token_loss, importance_ratio
from swarmrl.rl.losses import (
    cispo_token_loss,
    dapo_token_loss,
    gspo_token_loss,
    normaliser,
    trust_region_token_loss,
)
from swarmrl.rl.metrics import clip_grad_norm

__all__ = [
    "cispo_token_loss",
    "clip_grad_norm",
    "clipped_token_loss",
    "correction_weights",
    "dapo_token_loss",
    "fill_with_informative",
    "group_advantages",
    "gspo_token_loss",
    "importance_ratio",
    "is_informative",
    "k3_kl",
    "kl_penalty",
    "mismatch_kl",
    "normaliser",
    "pass_rate_mask",
    "token_logprobs",
    "trust_region_token_loss",
]
