"""The models and cheats of the verifiable-inference benchmarks (``bench/toploc.py``,
``bench/cross_engine.py``): the tiny reverse-task Llama and its variants, the honest-work
scorer, and every known cheat as a builder of (bundle, claim) submissions.

Knows nothing about thresholds, engines' costs or reporting.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.envs import ReverseEnv
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.testing import cheats as attacks
from swarmrl.toploc.calibrate import generate_without_cache

DIGEST = "5e" * 32
ENV = ReverseEnv(length=12)


def train(model: torch.nn.Module, tokenizer, steps: int, seed: int, snapshot_at: int | None = None):
    """Teacher-forced training on reverse tasks; returns the state dict at ``snapshot_at``."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tasks = ENV.sample("train", steps * 32, seed)
    snapshot = None
    model.train()
    for step in range(steps):
        batch = tasks[step * 32 : (step + 1) * 32]
        rows = [
            tokenizer.encode(t.prompt) + tokenizer.encode(t.answer) + [tokenizer.eos_token_id]
            for t in batch
        ]
        ids = torch.tensor(rows)  # all rows have the same length
        labels = ids.clone()
        labels[:, : len(tokenizer.encode(batch[0].prompt))] = -100
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if snapshot_at is not None and step + 1 == snapshot_at:
            snapshot = copy.deepcopy(model.state_dict())
    model.eval()
    return snapshot, float(loss.detach())


def scorer_for(tokenizer):
    by_prompt = {}

    def score(prompt: Sequence[int], output: Sequence[int]) -> float:
        text = tokenizer.decode(list(prompt))
        if text not in by_prompt:
            body = text.rstrip(":")
            by_prompt[text] = body[::-1]
        completion = tokenizer.decode(list(output), skip_special_tokens=True)
        answer = by_prompt[text]
        hits = sum(a == b for a, b in zip(answer, completion.strip(), strict=False))
        return hits / len(answer)

    return score


def prompts_for(tokenizer, count: int, seed: int) -> list[list[int]]:
    return [tokenizer.encode(t.prompt) for t in ENV.sample("heldout", count, seed)]


def detection(verifier, worker, subs, honest_subs):
    """Rejections among ``subs``; a submission byte-identical to the honest one for the same
    prompt and seed (same tokens, log-probs, reward and chunks) is counted apart: no verifier can
    tell it from honest work, and it does no harm."""
    items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    verdicts = verifier.check_many(items)
    genuine = {
        (tuple(c.prompt_tokens), b.seed): (c.output_tokens, c.logprobs, c.reward, b.chunks)
        for b, c in honest_subs
    }
    rejected, codes, same, hidden_pass, worst, lp_err, lp_share = 0, {}, 0, 0, [], [], []
    tolerance = verifier.config.logprob_tolerance
    for verdict, (bundle, claim) in zip(verdicts, subs, strict=True):
        key = (tuple(claim.prompt_tokens), bundle.seed)
        if genuine.get(key) == (claim.output_tokens, claim.logprobs, claim.reward, bundle.chunks):
            same += 1
            continue
        rejected += not verdict.accepted
        if verdict.chunks:  # the hidden-state comparison ran: did every chunk pass it?
            hidden_pass += all(c.passed for c in verdict.chunks)
            worst.append(
                max(128.0 if c.mant_err_mean is None else c.mant_err_mean for c in verdict.chunks)
            )
        replayed = verdict.behaviour_logprobs
        if replayed is not None and len(replayed) == len(claim.logprobs) and replayed:
            gaps = [abs(a - b) for a, b in zip(claim.logprobs, replayed, strict=True)]
            lp_err.append(max(gaps))
            lp_share.append(sum(not g <= tolerance for g in gaps) / len(gaps))
        for code in verdict.codes:
            codes[code] = codes.get(code, 0) + 1
    return {
        "samples": len(subs) - same,
        "rejected": rejected,
        "identical_to_honest": same,
        "codes": codes,
        "hidden_states_pass": hidden_pass,  # samples whose every chunk passed (weak signal)
        # median over samples of the worst chunk's mantissa error (128 = no exponent matched)
        "worst_chunk_mant_err_median": float(statistics.median(worst)) if worst else None,
        # the weakest and the median sample's largest |claimed - replayed| log-prob (nats)
        "logprob_err_min": min(lp_err) if lp_err else None,
        "logprob_err_median": float(statistics.median(lp_err)) if lp_err else None,
        # the weakest sample's share of tokens off by more than logprob_tolerance (the
        # verifier lets up to logprob_outlier_share of them, at least one, pass)
        "logprob_off_share_min": min(lp_share) if lp_share else None,
    }


def generate(engine, model, prompts, params, seeds, batch: int, cache: bool):
    """Honest generations in batches of ``batch``: by the engine (its KV cache) or by a plain
    full-forward loop without a cache."""
    out = []
    for start in range(0, len(prompts), batch):
        p, s = prompts[start : start + batch], seeds[start : start + batch]
        if cache:
            out += engine.generate(p, params, s, return_hidden=True)
        else:
            out += generate_without_cache(
                model, p, params, s, sorted(engine.eos_ids), engine.pad_id
            )
    return out


def build_models(started: float, tiny: TinyModelConfig | None = None) -> SimpleNamespace:
    """The declared model (trained; ``tiny``'s shape, the default one if None), its older
    version, the random-init model, a cheap model."""
    tokenizer = build_char_tokenizer(ENV.alphabet)
    tiny = tiny or TinyModelConfig()
    torch.manual_seed(0)
    model = create_tiny_model(tiny, tokenizer)
    untrained = copy.deepcopy(model)
    older_state, loss = train(model, tokenizer, 150, seed=1, snapshot_at=100)
    older = copy.deepcopy(model)
    older.load_state_dict(older_state)
    torch.manual_seed(5)
    cheap_cfg = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128)
    cheap = create_tiny_model(cheap_cfg, tokenizer)
    _, cheap_loss = train(cheap, tokenizer, 150, seed=2)
    print(
        f"trained: loss {loss:.3f}, cheap {cheap_loss:.3f} ({time.perf_counter() - started:.0f}s)"
    )
    return SimpleNamespace(
        model=model,
        untrained=untrained,
        older=older,
        cheap=cheap,
        tiny=tiny,
        tokenizer=tokenizer,
        score=scorer_for(tokenizer),
        prompt_fn=lambda count, seed: prompts_for(tokenizer, count, seed),
        training={"final_loss": loss, "cheap_final_loss": cheap_loss},
    )


def cheat_cases(env: SimpleNamespace, worker: attacks.Worker, prompts, seeds, engine_for) -> dict:
    """Every cheat as name -> builder of its submissions for ``prompts`` / ``seeds``.

    ``worker`` holds the declared model's engine; ``engine_for(model)`` is the engine a
    cheater runs ``model`` on (called inside the builder, just before it generates).
    """
    model, tokenizer, tiny = env.model, env.tokenizer, env.tiny
    rng = random.Random(3)

    def perturbed(scale):
        m = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
        return engine_for(m)

    if not hasattr(env, "other"):  # trained once, shared by every call
        torch.manual_seed(99)
        env.other = create_tiny_model(tiny, tokenizer)
        train(env.other, tokenizer, 150, seed=9)
    other_model = env.other
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    substitutes = env.prompt_fn(len(prompts), 78)
    return {
        "perturbed weights (1e-2 rel)": lambda: attacks.with_engine(
            worker, perturbed(1e-2), prompts, seeds
        ),
        "perturbed weights (1e-3 rel)": lambda: attacks.with_engine(
            worker, perturbed(1e-3), prompts, seeds
        ),
        "older version (step 100 of 150)": lambda: attacks.with_engine(
            worker, engine_for(env.older), prompts, seeds
        ),
        "different model": lambda: attacks.with_engine(
            worker, engine_for(other_model), prompts, seeds
        ),
        "bf16 weights claimed as fp32": lambda: attacks.with_engine(
            worker, engine_for(bf16_model), prompts, seeds
        ),
        "changed prompt": lambda: attacks.changed_prompt(worker, prompts, seeds, substitutes),
        "one tampered output token": lambda: attacks.tampered_token(
            worker, prompts, seeds, len(tokenizer), rng
        ),
        "other temperature (0.7 for 1.0)": lambda: attacks.other_sampling(
            worker, prompts, seeds, temperature=0.7
        ),
        "other seed": lambda: attacks.other_sampling(worker, prompts, seeds, seed_offset=10**6),
        "cheap decode + real prefill proof": lambda: attacks.cheap_decode(
            worker, TorchEngine(env.cheap, tokenizer), prompts, seeds
        ),
        "early truncation": lambda: attacks.truncated(worker, prompts, seeds, rng),
        "forged reward": lambda: attacks.forged_reward(worker, prompts, seeds, env.score),
        "proof copied from another sample": lambda: attacks.copied_proof(worker, prompts, seeds),
    }
