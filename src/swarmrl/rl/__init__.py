"""swarmrl.rl: the pure maths of learning — group advantages, the importance ratio and the
two-sided clipped loss, token-level normalization, k3 KL, chunked log-probs, filters and
gradient clipping. Each module states its formula in its docstring.
"""

from swarmrl.rl.advantages import group_advantages
from swarmrl.rl.filters import fill_with_informative, is_informative, pass_rate_mask
from swarmrl.rl.kl import k3_kl
from swarmrl.rl.logprobs import token_logprobs
from swarmrl.rl.loss import clipped_token_loss, importance_ratio
from swarmrl.rl.metrics import clip_grad_norm

__all__ = [
    "clip_grad_norm",
    "clipped_token_loss",
    "fill_with_informative",
    "group_advantages",
    "importance_ratio",
    "is_informative",
    "k3_kl",
    "pass_rate_mask",
    "token_logprobs",
]
