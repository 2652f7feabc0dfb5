"""The verifier against a real tiny engine: honest samples pass, every rejection path fires."""

import base64
import copy
import math
import random

import pytest
import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.sampling import gumbel_noise
from swarmrl.inference.types import Prefill
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc.bundle import seal
from swarmrl.toploc.calibrate import generate_without_cache, measure, recommend
from swarmrl.toploc.prefill import prefill_many
from swarmrl.toploc.verify import Verifier

DIGEST = "ab" * 32
TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)


def _scorer(prompt, output):
    """Toy reward: share of output tokens equal to the first prompt token."""
    return sum(t == prompt[0] for t in output) / len(output)


@pytest.fixture(scope="module")
def world():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest on a shared machine
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdefghijklmnop:")
    model = create_tiny_model(TINY, tokenizer)
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    worker = attacks.Worker(engine, KeyPair.from_seed(bytes(32)), params, 3, DIGEST)
    # thresholds calibrated on honest samples (cached and uncached decoding), not the test ones
    rng = random.Random(0)
    letters = tokenizer.encode("abcdefghijklmnop")
    calib = [[rng.choice(letters) for _ in range(8)] for _ in range(4)]
    measured = measure(
        engine, engine.generate(calib, params, range(4), return_hidden=True), params, ToplocConfig()
    )
    nocache = generate_without_cache(model, calib, params, range(4, 8), sorted(engine.eos_ids))
    measured.extend(measure(engine, nocache, params, ToplocConfig()))
    verifier = Verifier(
        engine,
        ToplocConfig(**recommend(measured, 128)),
        eos_token_ids=engine.eos_ids,
        vocab_size=len(tokenizer),
        scorer=_scorer,
    )
    prompts = [[rng.choice(letters) for _ in range(8)] + tokenizer.encode(":") for _ in range(6)]
    yield {
        "tokenizer": tokenizer,
        "model": model,
        "engine": engine,
        "worker": worker,
        "verifier": verifier,
        "prompts": prompts,
        "seeds": list(range(100, 106)),
    }
    torch.set_num_threads(previous)


def _check(world, subs, seeds=None, prompts=None):
    worker, verifier = world["worker"], world["verifier"]
    prompts = prompts or world["prompts"]
    seeds = seeds or world["seeds"]
    items = [
        (b, c, worker.assignment(p, s)) for (b, c), p, s in zip(subs, prompts, seeds, strict=False)
    ]
    return verifier.check_many(items)


def test_honest_samples_pass_with_replayed_credit_and_logprobs(world):
    subs = attacks.honest(world["worker"], world["prompts"], world["seeds"])
    for verdict, (bundle, claim) in zip(_check(world, subs), subs, strict=True):
        assert verdict.accepted, verdict.reasons
        assert verdict.tokens_replayed == len(claim.prompt_tokens) + len(claim.output_tokens)
        assert verdict.behaviour_logprobs == pytest.approx(claim.logprobs, abs=1e-5)
        assert verdict.reward == _scorer(claim.prompt_tokens, claim.output_tokens)
        assert len(verdict.chunks) == len(bundle.chunks) and all(c.passed for c in verdict.chunks)
    assert any(len(b.chunks) > 1 for b, _ in subs)  # decode chunks were exercised


@pytest.mark.parametrize(
    "raw",
    [None, 17, "not json", b"{", {"chunks": [float("nan")]}, [], {"scheme": "other"}],
)
def test_garbage_bundles_are_malformed_rejections(world, raw):
    (_, claim), prompt, seed = (
        attacks.honest(world["worker"], world["prompts"][:1], [1])[0],
        world["prompts"][0],
        1,
    )
    verdict = world["verifier"].check(raw, claim, world["worker"].assignment(prompt, seed))
    assert not verdict.accepted and verdict.codes == {"malformed"}
    assert verdict.tokens_replayed == 0


def test_oversized_nan_and_truncated_proofs_are_rejected(world):
    worker, verifier = world["worker"], world["verifier"]
    prompt, seed = world["prompts"][0], world["seeds"][0]
    bundle, claim = attacks.honest(worker, [prompt], [seed])[0]
    assignment = worker.assignment(prompt, seed)
    huge = bundle.model_dump_json() + " " * verifier.config.max_bundle_bytes
    assert verifier.check(huge, claim, assignment).codes == {"malformed"}
    nan_claim = claim.model_dump()
    nan_claim["logprobs"] = [float("nan")] * len(claim.logprobs)
    assert verifier.check(bundle, nan_claim, assignment).codes == {"malformed"}
    short = base64.b64encode(base64.b64decode(bundle.chunks[0])[:100]).decode()
    cut = seal(
        bundle.model_copy(update={"chunks": [short, *bundle.chunks[1:]]}), claim, worker.keypair
    )
    assert verifier.check(cut, claim, assignment).codes == {"structure"}
    fewer = seal(
        bundle.model_copy(update={"chunks": bundle.chunks[:-1] or ["AAAA"]}), claim, worker.keypair
    )
    if len(bundle.chunks) > 1:
        assert verifier.check(fewer, claim, assignment).codes == {"structure"}
    null = base64.b64encode(bytes(258)).decode()  # the reference library's null proof
    nulled = seal(
        bundle.model_copy(update={"chunks": [null] * len(bundle.chunks)}), claim, worker.keypair
    )
    assert verifier.check(nulled, claim, assignment).codes == {"structure"}


def test_binding_and_assignment_rejections(world):
    worker, verifier = world["worker"], world["verifier"]
    prompt, seed = world["prompts"][1], world["seeds"][1]
    bundle, claim = attacks.honest(worker, [prompt], [seed])[0]
    assignment = worker.assignment(prompt, seed)
    # claim edited after signing
    edited = claim.model_copy(update={"output_tokens": [*claim.output_tokens[:-1], 3]})
    assert verifier.check(bundle, edited, assignment).codes == {"binding"}
    forged = bundle.model_copy(update={"signature": "00" * 64})
    assert verifier.check(forged, claim, assignment).codes == {"binding"}
    # signed by someone else than the leaseholder
    other = seal(bundle, claim, KeyPair.from_seed(bytes([7] * 32)))
    assert verifier.check(other, claim, assignment).codes == {"assignment"}
    for field, value in [("seed", seed + 1), ("policy_version", 2), ("model_digest", "cd" * 32)]:
        changed = seal(bundle.model_copy(update={field: value}), claim, worker.keypair)
        assert verifier.check(changed, claim, assignment).codes == {"assignment"}, field
    wrong_prompt = worker.assignment(world["prompts"][2], seed)
    assert "assignment" in verifier.check(bundle, claim, wrong_prompt).codes


def test_wrong_weights_fail_hidden_states(world):
    perturbed = copy.deepcopy(world["model"])
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    subs = attacks.with_engine(
        world["worker"],
        TorchEngine(perturbed, world["tokenizer"]),
        world["prompts"],
        world["seeds"],
    )
    for verdict in _check(world, subs):
        assert "hidden_states" in verdict.codes and verdict.failing_chunks


def test_cheap_decode_is_caught_by_sampling_replay(world):
    torch.manual_seed(1)
    cheap = TorchEngine(create_tiny_model(TINY, world["tokenizer"]), world["tokenizer"])
    subs = attacks.cheap_decode(world["worker"], cheap, world["prompts"], world["seeds"])
    genuine = attacks.honest(world["worker"], world["prompts"], world["seeds"])
    differing = 0
    for verdict, (_, claim), (_, honest_claim) in zip(
        _check(world, subs), subs, genuine, strict=True
    ):
        assert "hidden_states" not in verdict.codes  # the proofs are genuine
        if claim.output_tokens == honest_claim.output_tokens:
            continue  # the cheap model happened to sample exactly the real model's tokens
        differing += 1
        assert not verdict.accepted and verdict.codes & {"sampling", "termination"}
    assert differing >= 3


def test_tampered_token_other_seed_and_temperature(world):
    worker = world["worker"]
    rng = random.Random(5)
    vocab = len(world["tokenizer"])
    for subs in (
        attacks.tampered_token(worker, world["prompts"], world["seeds"], vocab, rng),
        attacks.other_sampling(worker, world["prompts"], world["seeds"], seed_offset=1000),
        attacks.other_sampling(worker, world["prompts"], world["seeds"], temperature=0.5),
    ):
        for verdict in _check(world, subs):
            assert not verdict.accepted and verdict.codes & {"sampling", "logprobs", "termination"}


def test_truncation_forged_reward_copied_proof_changed_prompt(world):
    worker = world["worker"]
    prompts, seeds = world["prompts"], world["seeds"]
    subs = attacks.truncated(worker, prompts, seeds, random.Random(2))
    verdicts = world["verifier"].check_many(
        [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    )
    assert verdicts and all("termination" in v.codes for v in verdicts)
    for verdict in _check(world, attacks.forged_reward(worker, prompts, seeds, _scorer)):
        assert verdict.codes == {"reward"}
    copied = attacks.copied_proof(worker, prompts, seeds)
    verdicts = world["verifier"].check_many(
        [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in copied]
    )
    assert verdicts and all("hidden_states" in v.codes for v in verdicts)
    rng = random.Random(9)
    subst = [[rng.randrange(3, 19) for _ in p] for p in prompts]
    for verdict in _check(world, attacks.changed_prompt(worker, prompts, seeds, subst)):
        assert "hidden_states" in verdict.codes


def test_out_of_vocab_and_failed_replay_never_raise(world):
    worker = world["worker"]
    prompt, seed = world["prompts"][0], world["seeds"][0]
    bundle, claim = attacks.honest(worker, [prompt], [seed])[0]
    bad = claim.model_copy(update={"output_tokens": [10**6] * len(claim.output_tokens)})
    resealed = seal(bundle, bad, worker.keypair)
    assignment = worker.assignment(prompt, seed)
    assert world["verifier"].check(resealed, bad, assignment).codes == {"structure"}
    blind = Verifier(world["engine"], eos_token_ids=world["engine"].eos_ids)  # no vocab check
    verdict = blind.check(resealed, bad, assignment)
    assert verdict.codes == {"replay"} and not verdict.accepted


def test_batched_replay_matches_single_prefills_and_isolates_bad_rows(world):
    engine = world["engine"]
    gens = engine.generate(world["prompts"], world["worker"].params, world["seeds"])
    pairs = [(g.prompt_tokens, g.output_tokens) for g in gens]
    pairs += [([], [4]), (world["prompts"][0], [10**6])]
    batched = prefill_many(engine, pairs, max_batch_tokens=64)  # forces several batches
    for (prompt, output), got in zip(pairs[:-2], batched, strict=False):
        want = engine.prefill(prompt, output)
        assert torch.allclose(got.hidden_states, want.hidden_states, atol=1e-5)
        assert torch.allclose(got.logits, want.logits, atol=1e-5)
    assert all(isinstance(r, ValueError) for r in batched[-2:])


def test_forged_logprobs_and_inner_stop_token(world):
    worker, verifier = world["worker"], world["verifier"]
    subs = attacks.honest(worker, world["prompts"], world["seeds"])
    bundle, claim = max(subs, key=lambda s: len(s[1].output_tokens))
    assignment = worker.assignment(claim.prompt_tokens, bundle.seed)
    shifted = claim.model_copy(update={"logprobs": [x + 0.05 for x in claim.logprobs]})
    verdict = verifier.check(seal(bundle, shifted, worker.keypair), shifted, assignment)
    assert verdict.codes == {"logprobs"}
    assert verdict.behaviour_logprobs == pytest.approx(claim.logprobs, abs=1e-5)
    eos = sorted(world["engine"].eos_ids)[0]
    tokens = list(claim.output_tokens)
    tokens[len(tokens) // 2] = eos
    inner = claim.model_copy(update={"output_tokens": tokens})
    verdict = verifier.check(seal(bundle, inner, worker.keypair), inner, assignment)
    assert "termination" in verdict.codes and any("inside" in r.detail for r in verdict.reasons)


def test_per_row_steps_give_the_engine_noise():
    """The replay draws all steps of a sample at once; it must equal step-by-step noise."""
    seeds = torch.tensor([5, 2**40 + 3, 77])
    together = gumbel_noise(seeds, torch.tensor([0, 7, 3]), 50)
    one_by_one = [gumbel_noise(seeds[i : i + 1], s, 50)[0] for i, s in enumerate([0, 7, 3])]
    assert torch.equal(together, torch.stack(one_by_one))


def test_binding_digest_of_a_fixed_bundle_is_pinned() -> None:
    """The signed canonical form: these bytes are what every worker and validator hash, so a
    change to the sampling type (tuple vs list, field order, defaults) must not move them."""
    from swarmrl.protocol.proofs import ProofBundle, SampleClaim
    from swarmrl.toploc.bundle import binding_digest

    wire = {
        "policy_version": 3,
        "model_digest": "9f" * 32,
        "sampling": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "max_new_tokens": 12,
            "stop_token_ids": [2, 7],
        },
        "seed": 12345,
        "chunk_size": 32,
        "topk": 128,
        "chunks": ["AAEC"],
        "worker_key": "ab" * 32,
        "digest": "0" * 64,
        "signature": "0" * 128,
    }
    claim = SampleClaim(
        prompt_tokens=[1, 7, 9],
        output_tokens=[4, 4, 2],
        logprobs=[-0.1, -2.3, -0.5],
        finish_reason="eos",
        reward=None,
    )
    pinned = "6bc9bd221bfa32ec859b539fdbe5ca3b7d465969979c1fc7179e4334168d0cc3"
    bundle = ProofBundle.model_validate(wire)
    assert binding_digest(bundle, claim) == pinned
    # built in process (tuple of stop ids) or parsed from the wire (JSON list): same digest
    rebuilt = bundle.model_copy(update={"sampling": SamplingParams(**wire["sampling"])})
    assert binding_digest(rebuilt, claim) == pinned
    assert binding_digest(ProofBundle.model_validate_json(bundle.model_dump_json()), claim) == (
        pinned
    )


def _strict(world) -> Verifier:
    """The world's verifier at the calibrated log-prob floor of 1e-4 nats (bench and demo)."""
    verifier = world["verifier"]
    config = verifier.config.model_copy(update={"logprob_tolerance": 1e-4})
    return Verifier(
        world["engine"],
        config,
        eos_token_ids=verifier.eos_token_ids,
        vocab_size=verifier.vocab_size,
        scorer=verifier.scorer,
    )


def _declaring(worker, bundle, claim, logprobs):
    """The same sample, honestly sealed by the worker, with these declared log-probs."""
    declared = claim.model_copy(update={"logprobs": logprobs})
    return seal(bundle, declared, worker.keypair), declared


def test_isolated_small_logprob_misses_of_honest_work_pass(world):
    """The honest tail: where the policy is ill-conditioned in fp32, an honest worker's decode
    and the validator's prefill differ by a few 1e-4 nats at an isolated token (measured in a
    demo run: 1-3.9e-4 nats at decode step 1, every other token within 1.6e-6)."""
    worker, verifier = world["worker"], _strict(world)
    subs = attacks.honest(worker, world["prompts"], world["seeds"])
    bundle, claim = max(subs, key=lambda s: len(s[1].output_tokens))
    assert len(claim.output_tokens) >= 8
    assignment = worker.assignment(claim.prompt_tokens, bundle.seed)
    assert verifier.check(bundle, claim, assignment).accepted

    one = list(claim.logprobs)
    one[1] -= 3.9e-4  # the demo's worst case: -6.6037 declared, -6.6033 replayed
    verdict = verifier.check(*_declaring(worker, bundle, claim, one), assignment)
    assert verdict.accepted, verdict.reasons
    # what trains is the validator's replay, not the declared miss
    assert verdict.behaviour_logprobs == pytest.approx(claim.logprobs, abs=1e-5)

    few = list(claim.logprobs)
    few[1] += 2e-4
    few[5] -= 3e-4
    verdict = verifier.check(*_declaring(worker, bundle, claim, few), assignment)
    assert verdict.accepted, verdict.reasons


def test_logprob_misses_on_most_tokens_or_one_large_one_are_rejected(world):
    worker, verifier = world["worker"], _strict(world)
    subs = attacks.honest(worker, world["prompts"], world["seeds"])
    bundle, claim = max(subs, key=lambda s: len(s[1].output_tokens))
    assignment = worker.assignment(claim.prompt_tokens, bundle.seed)

    broad = [x - 3e-4 for x in claim.logprobs]  # each as small as an isolated miss
    verdict = verifier.check(*_declaring(worker, bundle, claim, broad), assignment)
    assert verdict.codes == {"logprobs"}
    assert "isolated" in verdict.reasons[0].detail

    large = list(claim.logprobs)
    large[2] += 1.5e-3  # past the ceiling of 10 x the tolerance
    verdict = verifier.check(*_declaring(worker, bundle, claim, large), assignment)
    assert verdict.codes == {"logprobs"}

    missing = list(claim.logprobs)
    missing[3] = float("nan")
    verdict = verifier.check(*_declaring(worker, bundle, claim, missing), assignment)
    assert not verdict.accepted


def test_weight_noise_cheat_is_still_rejected_by_logprobs(world):
    """Weights perturbed by 1e-3 of their spread move nearly every token's log-prob by a few
    1e-4 nats: the hidden states pass, the log-probs catch every sample of 4 or more tokens
    (and so the submission; shorter samples can look like an isolated honest miss)."""
    worker, verifier = world["worker"], _strict(world)
    cheat = copy.deepcopy(world["model"])
    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in cheat.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 1e-3 * p.std())
    engine = TorchEngine(cheat, world["tokenizer"])
    subs = attacks.with_engine(worker, engine, world["prompts"], world["seeds"])
    verdicts = verifier.check_many(
        [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    )
    judged = [v for v, (_, c) in zip(verdicts, subs, strict=True) if len(c.output_tokens) >= 4]
    assert len(judged) >= 4
    assert all(not v.accepted and "logprobs" in v.codes for v in judged)
    assert any(v.codes == {"logprobs"} for v in judged)  # log-probs alone catch it


class _NearTieReplayer:
    """The world's engine, except that at ``steps`` the replay's logits make the honest token
    trail the seeded runner-up by ``trail`` score units: the fp32 decode/prefill tail (a few
    1e-4 at an isolated ill-conditioned input) meeting a near-tie of the Gumbel-max choice."""

    def __init__(self, engine, seed: int, steps: list[int], trail: float):
        self.engine, self.seed, self.steps, self.trail = engine, seed, steps, trail

    def prefill(self, prompt_tokens, output_tokens):
        replay = self.engine.prefill(prompt_tokens, output_tokens)
        logits = replay.logits.clone()  # [n, vocab]; temperature 1, no top-k/top-p
        for step in self.steps:
            noise = gumbel_noise(torch.tensor([self.seed]), step, logits.shape[1])[0]
            scores = logits[step] + noise
            mine = int(output_tokens[step])
            runner_up = int(scores.masked_fill(torch.arange(len(scores)) == mine, -1e9).argmax())
            logits[step, runner_up] += float(scores[mine] - scores[runner_up]) + self.trail
        return Prefill(logits=logits, hidden_states=replay.hidden_states)


def _near_tie_verdict(world, steps: list[int], trail: float):
    worker, verifier = world["worker"], world["verifier"]
    subs = attacks.honest(worker, world["prompts"], world["seeds"])
    bundle, claim = max(subs, key=lambda s: len(s[1].output_tokens))
    assert len(claim.output_tokens) >= 8
    # sampling at the calibrated floor; log-probs loose, since raising the runner-up's logit
    # moves the honest token's log-prob too and this test is about the sampling rule alone
    config = verifier.config.model_copy(
        update={"sampling_tolerance": 1e-4, "logprob_tolerance": 1.0}
    )
    near_tie = Verifier(
        _NearTieReplayer(world["engine"], bundle.seed, steps, trail),
        config,
        eos_token_ids=verifier.eos_token_ids,
        vocab_size=verifier.vocab_size,
        scorer=verifier.scorer,
    )
    return near_tie.check(bundle, claim, worker.assignment(claim.prompt_tokens, bundle.seed))


def test_honest_token_at_an_isolated_near_tie_passes(world):
    """One honest token trailing the replay's seeded choice by 3e-4 (3 x the calibrated
    tolerance of 1e-4): an isolated near-tie miss, accepted."""
    verdict = _near_tie_verdict(world, [1], 3e-4)
    assert verdict.accepted, verdict.reasons


def test_near_tie_misses_past_the_ceiling_or_repeated_are_rejected(world):
    far = _near_tie_verdict(world, [1], 1.5e-3)  # past 10 x 1e-4
    assert far.codes == {"sampling"}
    many = _near_tie_verdict(world, [1, 3, 5], 3e-4)  # one isolated miss per sample by default
    assert many.codes == {"sampling"} and "3 tokens" in many.reasons[0].detail


def test_an_end_token_where_the_model_did_not_end_is_rejected(world):
    """The cut-short sample ends with the end token claimed "eos", its log-prob the model's
    own: the seeded replay rejects it (the end token is not the sampled choice), and the
    termination check exactly where the model gave the end token less than ``eos_min_prob``
    (on this untrained model, with its few tokens, it rarely does)."""
    worker = world["worker"]
    subs = attacks.stopped_early(worker, world["prompts"], world["seeds"], random.Random(4))
    verdicts = world["verifier"].check_many(
        [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    )
    assert len(verdicts) >= 4
    for verdict, (_, claim) in zip(verdicts, subs, strict=True):
        assert claim.finish_reason == "eos" and claim.output_tokens[-1] in world["engine"].eos_ids
        assert not verdict.accepted
        assert "sampling" in verdict.codes, verdict.reasons
        unlikely = math.exp(claim.logprobs[-1]) < world["verifier"].config.eos_min_prob
        assert ("termination" in verdict.codes) == unlikely, verdict.reasons
        assert "logprobs" not in verdict.codes  # the end token's log-prob is the model's own
