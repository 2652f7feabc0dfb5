"""Known cheats of an inference worker, built for real, to measure what the verifier catches.

Each function returns ``(bundle, claim)`` pairs exactly as a dishonest worker would submit
them for the given prompts and seeds (the assignment), signed with the worker's own key so
the binding check passes and the content checks must do the catching:

* ``with_engine``      generate with other weights (perturbed, older, another model, other
                       dtype) and prove them honestly (the proofs match *those* weights);
                       ``int8_per_channel`` and ``fp8_per_channel`` make the cheapest such
                       models: int8 or float8 weights
* ``changed_prompt``   generate from other prompts of the same length, claim the assigned one
* ``tampered_token``   replace one output token after the fact, keep the proofs
* ``other_sampling``   sample with another temperature or seed, claim the assigned one
* ``cheap_decode``     decode with a cheaper model, then prove (and report log-probs) with one
                       prefill of the real model
* ``truncated``        stop early, claim "length" or "eos"
* ``stopped_early``    stop early with an end token where the model did not end, claim "eos",
                       with the replayed log-prob of that end token (only the seeded replay and
                       the end token's probability can tell)
* ``forged_reward``    report a reward the completion did not earn
* ``copied_proof``     attach another sample's chunk proofs

Used by ``bench/toploc.py`` and the tests. Knows nothing about pools or transport.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.sampling import mask_logits
from swarmrl.inference.types import Generation
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.proofs import Assignment, ProofBundle, SampleClaim
from swarmrl.toploc.bundle import build_bundles, claim_of, seal

Submission = tuple[ProofBundle, SampleClaim]


@dataclass
class Worker:
    """A worker's identity and the assignment context it answers."""

    engine: TorchEngine  # the declared model (an honest worker's engine)
    keypair: KeyPair
    params: SamplingParams
    policy_version: int
    model_digest: str
    chunk_size: int = 32
    topk: int = 128

    def assignment(self, prompt: Sequence[int], seed: int) -> Assignment:
        return Assignment(
            policy_version=self.policy_version,
            model_digest=self.model_digest,
            prompt_tokens=list(prompt),
            sampling=self.params,
            seed=seed,
            worker_key=self.keypair.public_key_hex,
        )

    def prove(
        self, generations: Sequence[Generation], rewards: Sequence[float | None] | None = None
    ) -> list[Submission]:
        """Sign proofs of ``generations`` as this worker (whatever produced them)."""
        bundles = build_bundles(
            generations,
            keypair=self.keypair,
            policy_version=self.policy_version,
            model_digest=self.model_digest,
            params=self.params,
            chunk_size=self.chunk_size,
            topk=self.topk,
        )
        rewards = rewards or [None] * len(generations)
        return [(b, claim_of(g, r)) for b, g, r in zip(bundles, generations, rewards, strict=True)]


def honest(
    worker: Worker, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
) -> list[Submission]:
    gens = worker.engine.generate(prompts, worker.params, seeds, return_hidden=True)
    return worker.prove(gens)


def with_engine(
    worker: Worker, engine: TorchEngine, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
) -> list[Submission]:
    """Generate and prove with ``engine`` (wrong weights or dtype), claim the declared model."""
    return worker.prove(engine.generate(prompts, worker.params, seeds, return_hidden=True))


@torch.no_grad()
def int8_per_channel(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose matrices are int8-quantized per output channel (symmetric,
    scale = max |row| / 127) and stored dequantized: what an int8 inference kernel computes."""
    quantized = copy.deepcopy(model)
    for param in quantized.parameters():
        if param.dim() == 2:
            scale = param.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # [out, 1]
            param.copy_((param / scale).round().clamp(-127, 127) * scale)
    return quantized


@torch.no_grad()
def fp8_per_channel(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose matrices are rounded to float8 e4m3 per output channel (scale =
    max |row| / 448, e4m3's largest normal) and stored dequantized in the model's dtype: what an
    fp8 inference kernel computes, emulated where there is none."""
    quantized = copy.deepcopy(model)
    for param in quantized.parameters():
        if param.dim() == 2:
            scale = param.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
            fp8 = (param.float() / scale).to(torch.float8_e4m3fn)
            param.copy_((fp8.float() * scale).to(param.dtype))
    return quantized


def changed_prompt(
    worker: Worker,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    substitutes: Sequence[Sequence[int]],
) -> list[Submission]:
    """Answer ``substitutes`` (same lengths) but claim the assigned ``prompts``."""
    gens = worker.engine.generate(substitutes, worker.params, seeds, return_hidden=True)
    for gen, prompt in zip(gens, prompts, strict=True):
        gen.prompt_tokens = list(prompt)
    return worker.prove(gens)


def tampered_token(
    worker: Worker,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    vocab: int,
    rng: random.Random,
) -> list[Submission]:
    """Honest generation, then one output token swapped for another ordinary token."""
    gens = worker.engine.generate(prompts, worker.params, seeds, return_hidden=True)
    stops = worker.engine.eos_ids | set(worker.params.stop_token_ids)
    for gen in gens:
        limit = len(gen.output_tokens) - (1 if gen.finish_reason == "eos" else 0)
        position = rng.randrange(max(limit, 1))
        choices = [t for t in range(vocab) if t not in stops and t != gen.output_tokens[position]]
        gen.output_tokens[position] = rng.choice(choices)
    return worker.prove(gens)


def other_sampling(
    worker: Worker,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    *,
    temperature: float | None = None,
    seed_offset: int = 0,
) -> list[Submission]:
    """Sample with another temperature and/or seed; claim the assigned ones."""
    params = worker.params
    if temperature is not None:
        params = params.model_copy(update={"temperature": temperature})
    gens = worker.engine.generate(
        prompts, params, [s + seed_offset for s in seeds], return_hidden=True
    )
    for gen, seed in zip(gens, seeds, strict=True):
        gen.seed = seed
    return worker.prove(gens)


def cheap_decode(
    worker: Worker, cheap: TorchEngine, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
) -> list[Submission]:
    """Tokens from ``cheap``; hidden states and log-probs from one real prefill each."""
    gens = cheap.generate(prompts, worker.params, seeds)
    for gen in gens:
        replay = worker.engine.prefill(gen.prompt_tokens, gen.output_tokens)
        logprobs = torch.log_softmax(mask_logits(replay.logits, worker.params), dim=-1)
        token = torch.tensor(gen.output_tokens)[:, None]
        gen.logprobs = logprobs.gather(1, token)[:, 0].tolist()
        gen.hidden_states = replay.hidden_states
    return worker.prove(gens)


def truncated(
    worker: Worker, prompts: Sequence[Sequence[int]], seeds: Sequence[int], rng: random.Random
) -> list[Submission]:
    """Honest generations cut short (samples of one token are skipped); claims alternate
    between "length" and "eos"."""
    gens = worker.engine.generate(prompts, worker.params, seeds, return_hidden=True)
    cut = []
    for index, gen in enumerate(g for g in gens if len(g.output_tokens) > 1):
        keep = rng.randrange(1, len(gen.output_tokens))
        p = len(gen.prompt_tokens)
        cut.append(
            Generation(
                prompt_tokens=gen.prompt_tokens,
                output_tokens=gen.output_tokens[:keep],
                logprobs=gen.logprobs[:keep],
                finish_reason="length" if index % 2 == 0 else "eos",
                seed=gen.seed,
                hidden_states=gen.hidden_states[: p + keep - 1],  # type: ignore[index]
            )
        )
    return worker.prove(cut)


def stopped_early(
    worker: Worker, prompts: Sequence[Sequence[int]], seeds: Sequence[int], rng: random.Random
) -> list[Submission]:
    """Honest generations cut short and ended with the end token at the cut, where the model
    did not end (samples without such a place are skipped), claimed "eos"; the end token's
    log-prob is the declared model's own, as a careful cheater would compute it with one
    prefill."""
    gens = worker.engine.generate(prompts, worker.params, seeds, return_hidden=True)
    ends = worker.engine.eos_ids
    end = min(ends)
    out = []
    for gen in gens:
        cuts = [k for k in range(1, len(gen.output_tokens)) if gen.output_tokens[k] not in ends]
        if not cuts:
            continue
        keep = rng.choice(cuts)
        output = [*gen.output_tokens[:keep], end]
        replay = worker.engine.prefill(gen.prompt_tokens, output)
        logprobs = torch.log_softmax(mask_logits(replay.logits[-1:], worker.params), dim=-1)
        out.append(
            Generation(
                prompt_tokens=gen.prompt_tokens,
                output_tokens=output,
                logprobs=[*gen.logprobs[:keep], float(logprobs[0, end])],
                finish_reason="eos",
                seed=gen.seed,
                hidden_states=gen.hidden_states[: len(gen.prompt_tokens) + keep],  # type: ignore[index]
            )
        )
    return worker.prove(out)


def forged_reward(
    worker: Worker,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    scorer: Callable[[Sequence[int], Sequence[int]], float],
) -> list[Submission]:
    """Honest generations reporting 1 - (true reward) + 0.5: never the earned value."""
    gens = worker.engine.generate(prompts, worker.params, seeds, return_hidden=True)
    rewards = [1.5 - scorer(g.prompt_tokens, g.output_tokens) for g in gens]
    return worker.prove(gens, rewards)


def copied_proof(
    worker: Worker, prompts: Sequence[Sequence[int]], seeds: Sequence[int]
) -> list[Submission]:
    """Each sample carries the chunks of another sample with the same chunk count, re-signed."""
    subs = honest(worker, prompts, seeds)
    by_count: dict[int, list[int]] = {}
    for i, (bundle, _) in enumerate(subs):
        by_count.setdefault(len(bundle.chunks), []).append(i)
    out = []
    for group in by_count.values():
        if len(group) < 2:
            continue
        for pos, i in enumerate(group):
            donor = subs[group[(pos + 1) % len(group)]][0]
            bundle, claim = subs[i]
            forged = bundle.model_copy(update={"chunks": donor.chunks})
            out.append((seal(forged, claim, worker.keypair), claim))
    return out
