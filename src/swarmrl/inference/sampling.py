"""Seeded Gumbel-max sampling: the exact, replayable rule that turns logits into a token.

Every operation here is a pure function of its inputs, so a validator holding its own logits
and the sample's ``(seed, step)`` regenerates the noise and re-derives the token.

Noise (counter-based, 32-bit integer arithmetic carried in int64 so no product overflows):

    mix32(x):  x ^= x >> 16;  x = (x * 0x21F0AAAD) mod 2^32;  x ^= x >> 15;
               x = (x * 0x735A2D97) mod 2^32;  x ^= x >> 15                  (x in [0, 2^32))
    seed in [0, 2^63):  lo = seed mod 2^32,  hi = seed >> 32
    key(seed, t) = mix32( mix32( mix32((hi + 0x9E3779B9) mod 2^32) XOR lo ) XOR t )
    w(v)         = mix32((v + 0x6A09E667) mod 2^32)                          (v = vocab id)
    h(seed,t,v)  = mix32( key(seed, t) XOR w(v) )
    u            = (floor(h / 2^8) + 0.5) / 2^24                              (exact in float32, 0 < u < 1)
    g(seed,t,v)  = float32( -ln(-ln(u)) )     (computed in float64, rounded once to float32)

``t`` is the decode step: 0 for the first output token, 1 for the second, and so on. The noise
of a sample depends on nothing else, so it is the same in any batch, order or machine.

Token rule at step t, given float32 logits ``z`` [vocab] of that position:

    1. s = z / T                                   (T = temperature; T = 1 when greedy)
    2. top-k (k > 0): s_v = -inf where s_v < (k-th largest s)     (ties at the k-th are kept)
    3. top-p (p < 1): sort s descending (stable: ties by lower id first), q = softmax(sorted);
       drop every token whose preceding mass sum(q before it) >= p  (the first always stays)
    4. logprob = log_softmax(s)[token]            (the restricted, renormalised distribution)
    5. token = argmax_v (s_v + g(seed, t, v))     greedy: argmax_v s_v; argmax picks the
       lowest id on exact ties; masked tokens (-inf) never win.

Knows nothing about models, caches or batching: it sees a [batch, vocab] logits matrix.
"""

from __future__ import annotations

import torch

from swarmrl.protocol import SamplingParams

_M32 = 0xFFFFFFFF
_MUL1 = 0x21F0AAAD  # both multipliers < 2^31, so x * c < 2^63 for x < 2^32
_MUL2 = 0x735A2D97
_SEED_HI_OFFSET = 0x9E3779B9
_VOCAB_OFFSET = 0x6A09E667
_vocab_words: dict[tuple[int, str], torch.Tensor] = {}


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer hash above, elementwise on an int64 tensor with values in [0, 2^32).

    Returns a new tensor; ``x`` is not modified.
    """
    x = x ^ (x >> 16)
    x.mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def noise_keys(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """key(seed, t) for each seed: int64 [B] in [0, 2^32).

    ``step`` is one decode step for all rows, or an int64 [B] tensor of per-row steps (a
    validator replaying every step of a sample at once).
    """
    seeds = seeds.to(torch.int64)
    if bool((seeds < 0).any()):
        raise ValueError("sampling seeds must lie in [0, 2^63)")
    if isinstance(step, torch.Tensor):
        step = step.to(device=seeds.device, dtype=torch.int64)
        if bool(((step < 0) | (step >= 2**32)).any()):
            raise ValueError("decode steps must lie in [0, 2^32)")
    elif not 0 <= step < 2**32:
        raise ValueError(f"decode step must lie in [0, 2^32), got {step}")
    lo = seeds & _M32
    hi = seeds >> 32
    return mix32(mix32(mix32((hi + _SEED_HI_OFFSET) & _M32) ^ lo) ^ step)


def _vocab_word_table(vocab: int, device: torch.device) -> torch.Tensor:
    """w(v) for v in [0, vocab): int64 [vocab], cached per (vocab, device)."""
    cache_key = (vocab, str(device))
    table = _vocab_words.get(cache_key)
    if table is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=device)
        table = mix32((ids + _VOCAB_OFFSET) & _M32)
        _vocab_words[cache_key] = table
    return table


def gumbel_noise(seeds: torch.Tensor, step: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """g(seed, t, v) for every seed and vocab id: float32 [B, vocab] on ``seeds.device``.

    ``step``: one step for all rows, or int64 [B] per-row steps (see ``noise_keys``).
    """
    keys = noise_keys(seeds, step)  # [B]
    h = mix32(keys[:, None] ^ _vocab_word_table(vocab, seeds.device)[None, :])  # [B, vocab]
    u = h.bitwise_right_shift_(8).to(torch.float64).add_(0.5).mul_(1.0 / 2**24)
    return u.log_().neg_().log_().neg_().to(torch.float32)


def gumbel_block(seeds: torch.Tensor, first_step: int, n_steps: int, vocab: int) -> torch.Tensor:
    """g for steps first_step .. first_step+n_steps-1 at once: float32 [B, n_steps, vocab].

    Same values as ``gumbel_noise`` step by step; one vectorised pass instead of n_steps.
    """
    batch = seeds.shape[0]
    steps = torch.arange(first_step, first_step + n_steps, device=seeds.device)
    rows = gumbel_noise(seeds.repeat_interleave(n_steps), steps.repeat(batch), vocab)
    return rows.view(batch, n_steps, vocab)


def mask_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 1-3: temperature-scaled logits with tokens outside top-k/top-p set to -inf.

    logits: [B, vocab] float32. Returns a new [B, vocab] float32 tensor.
    """
    scaled = logits.float()
    if not params.greedy and params.temperature != 1.0:
        scaled = scaled / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    seeds: torch.Tensor,
    step: int,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 for one decode step of a batch.

    logits: [B, vocab]; seeds: int64 [B]; noise: ``gumbel_noise(seeds, step, vocab)`` if the
    caller already has it (e.g. from ``gumbel_block``), else computed here.
    Returns (tokens int64 [B], logprobs float32 [B]).
    """
    masked = mask_logits(logits, params)  # [B, vocab]
    logprobs = torch.log_softmax(masked, dim=-1)
    if params.greedy:
        tokens = torch.argmax(masked, dim=-1)
    else:
        if noise is None:
            noise = gumbel_noise(seeds, step, masked.shape[-1])
        tokens = torch.argmax(masked + noise, dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
