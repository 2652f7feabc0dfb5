"""Episodes from untrusted workers: what a worker submits for a multi-turn task, what the pool
refuses on arrival, what the validator's judgement catches and what the trainer trains on.

Real parts throughout: a tiny random-init model in the torch engine, the worker's episode
generation with its per-call proofs, the pool's sample check, the validator's ``judge`` with
the verifier's replay, the trainer's recomputation. ``guess`` is the task: a random model's
turns are rarely numbers, so its episodes run several turns of ``?`` feedback (each a claim of
the worker's the validator recomputes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.envs import GuessEnv
from swarmrl.errors import ForgedEpisode, Invalid
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.pool.flow.samples import check_samples
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, EpisodeSegment, EpisodeTurn
from swarmrl.protocol.pool import PoolSpec, Sample, WorkUnit
from swarmrl.protocol.verdicts import PendingSubmission
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge
from swarmrl.roles.worker.forged import forge_text, forging
from swarmrl.roles.worker.rollouts import generate_episodes
from swarmrl.toploc.bundle import build_bundles
from swarmrl.trainer.source import trusted_episode

DIGEST = "ab" * 32
MAX_NEW = 3


@pytest.fixture(scope="module")
def setup():
    """(config, env, tokenizer, engine, worker key, versions) for ``guess`` with 16 numbers."""
    torch.manual_seed(0)
    config = load_config(
        [EMBEDDED_DEFAULT],
        ["model.tiny.hidden_size=32", "model.tiny.num_layers=1",
         "model.tiny.intermediate_size=64"],
    )  # fmt: skip
    env = GuessEnv(n=16, max_turns=4, token_budget=40)
    tokenizer = build_char_tokenizer(env.alphabet)
    engine = TorchEngine(create_tiny_model(config.model.tiny, tokenizer).eval(), tokenizer)
    worker = KeyPair.generate()
    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}
    return config, env, tokenizer, engine, worker, versions


def _work(worker: KeyPair, tokenizer, seed: int = 500) -> WorkUnit:
    return WorkUnit(
        lease_id="l0", pool_id="swarm", node_id=worker.node_id, task_indices=[0, 3, 5],
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(tokenizer.eos_token_id,)),
        seed=seed, min_version=0, deadline=1e12, origin_node_id=worker.node_id, origin_counter=0,
    )  # fmt: skip


def _prover(worker: KeyPair):
    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    return prove


def _pending(worker: KeyPair, work: WorkUnit, samples: list[Sample]) -> PendingSubmission:
    return PendingSubmission(
        submission_id="s0", node_id=worker.node_id, node_key=worker.public_key_hex,
        request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
        request_nonce="0" * 32, work=work, samples=samples,
    )  # fmt: skip


@pytest.fixture(scope="module")
def honest(setup):
    _, env, tokenizer, engine, worker, _ = setup
    work = _work(worker, tokenizer)
    return work, generate_episodes(engine, env, tokenizer, work, 0, _prover(worker))


def _judge(setup, work, samples):
    config, env, _, _, worker, versions = setup
    return judge(_pending(worker, work, samples), env, versions.__getitem__, config.toploc)


def _with_episode(sample: Sample, episode: Episode) -> Sample:
    """``sample`` claiming ``episode`` instead, its model-turn fields kept consistent."""
    calls = episode.calls()
    return sample.model_copy(
        update={
            "episode": episode,
            "output_tokens": [t for c in calls for t in c.output_tokens],
            "logprobs": [x for c in calls for x in c.logprobs],
        }
    )


def _first_env_turn(samples: list[Sample]) -> tuple[int, int]:
    """(sample index, turn index) of the first environment turn among ``samples``."""
    for i, s in enumerate(samples):
        assert s.episode is not None
        for k, turn in enumerate(s.episode.segments[0].turns):
            if turn.role == "env":
                return i, k
    raise AssertionError("no sample has an environment turn")


# --- honest work -------------------------------------------------------------------------


def test_a_worker_submits_each_episode_with_one_proof_per_model_call(setup, honest):
    _, env, tokenizer, _, worker, _ = setup
    work, samples = honest
    assert len(samples) == 6
    assert max(len(s.episode.calls()) for s in samples) >= 2  # multi-turn episodes
    for s in samples:
        calls = s.episode.calls()
        assert s.proof is None and len(s.turn_proofs) == len(calls)
        assert s.output_tokens == [t for c in calls for t in c.output_tokens]
        assert s.episode.reward is None
    spec = PoolSpec(
        pool_id="swarm", owner_key=worker.public_key_hex, task_count=16, samples_per_task=2,
        sampling=work.sampling,
    )  # fmt: skip
    tokens = check_samples(spec, work, samples, 0, 1 << 20)
    assert tokens == sum(len(s.output_tokens) for s in samples)


def test_honest_episodes_are_accepted_with_trusted_rewards_and_logprobs(setup, honest):
    _, env, tokenizer, _, _, _ = setup
    work, samples = honest
    judgement = _judge(setup, work, samples)
    verdict = judgement.verdict
    assert verdict is not None and verdict.accept, verdict
    assert [len(b) for b in verdict.behaviour_logprobs] == [len(s.output_tokens) for s in samples]
    for s, b in zip(samples, verdict.behaviour_logprobs, strict=True):
        assert b == pytest.approx(s.logprobs, abs=1e-3)  # the replay of the same model
    want = [
        env.score_episode(env.task("train", s.task_index), s.episode.seed, _transcript(
            env, tokenizer, s)).reward
        for s in samples
    ]  # fmt: skip
    assert judgement.rewards == want
    # the trainer recomputes the same episodes and masks environment tokens out of the loss
    for s, b in zip(samples, verdict.behaviour_logprobs, strict=True):
        task = env.task("train", s.task_index)
        completions = trusted_episode(env, tokenizer, task, s, b, MAX_NEW)
        assert sum(c.sampled_tokens for c in completions) == len(s.output_tokens)
        env_tokens = sum(
            t.end - t.start for seg in s.episode.segments for t in seg.turns if t.role == "env"
        )
        masked = sum(len(c.output_tokens) - c.sampled_tokens for c in completions)
        assert masked == env_tokens


def _transcript(env, tokenizer, sample):
    from swarmrl.trainer.episode_check import replay_episode

    task = env.task("train", sample.task_index)
    _, state = replay_episode(env, tokenizer, task, sample.episode, MAX_NEW)
    return state.transcript


# --- what the validator catches -------------------------------------------------------------


def test_a_worker_forging_environment_turns_is_rejected_and_never_trained(setup):
    _, env, tokenizer, engine, worker, _ = setup
    work = _work(worker, tokenizer, seed=501)
    forged = generate_episodes(engine, forging(env), tokenizer, work, 0, _prover(worker))
    verdict = _judge(setup, work, forged).verdict
    assert verdict is not None and not verdict.accept and verdict.severity == "hard"
    assert "env_mismatch" in verdict.reasons[0], verdict.reasons
    i, _ = _first_env_turn(forged)
    with pytest.raises(ForgedEpisode, match="env_mismatch"):
        trusted_episode(
            env, tokenizer, env.task("train", forged[i].task_index), forged[i],
            forged[i].logprobs, MAX_NEW,
        )  # fmt: skip


def test_forged_text_changes_every_number():
    assert forge_text("[201954]") == "[201955]"
    assert forge_text("? 1-16") == "? 2-17"
    assert forge_text("<") == ">"
    assert forge_text("[?]") == "[1]"  # a refused call reads as a result


def test_environment_tokens_claimed_as_sampled_are_rejected(setup, honest):
    work, samples = honest
    i, k = _first_env_turn(samples)
    episode = samples[i].episode
    seg = episode.segments[0]
    turns = [t.model_copy() for t in seg.turns]
    env_turn = turns[k]
    # the env turn becomes part of the model turn before it: one span, with log-probs for it
    merged = EpisodeTurn(role="model", start=turns[k - 1].start, end=env_turn.end)
    turns = [*turns[: k - 1], merged, *turns[k + 1 :]]
    before = sum(t.end - t.start for t in seg.turns[:k] if t.role == "model")
    extra = [-0.5] * (env_turn.end - env_turn.start)
    logprobs = seg.logprobs[:before] + extra + seg.logprobs[before:]
    claim = Episode(
        seed=episode.seed,
        segments=[EpisodeSegment(tokens=seg.tokens, turns=turns, logprobs=logprobs)],
    )
    samples = list(samples)
    samples[i] = _with_episode(samples[i], claim)
    verdict = _judge(setup, work, samples).verdict
    assert verdict is not None and not verdict.accept
    assert any(code in verdict.reasons[0] for code in ("env_as_model", "over_budget")), verdict


def test_an_episode_cut_after_its_first_turn_is_rejected(setup, honest):
    work, samples = honest
    i, k = _first_env_turn(samples)
    seg = samples[i].episode.segments[0]
    kept = seg.turns[:k]  # context and model turn 0: the environment's reply dropped
    n_model = sum(t.end - t.start for t in kept if t.role == "model")
    claim = Episode(
        seed=samples[i].episode.seed,
        segments=[
            EpisodeSegment(
                tokens=seg.tokens[: kept[-1].end], turns=kept, logprobs=seg.logprobs[:n_model]
            )
        ],
    )
    samples = list(samples)
    samples[i] = _with_episode(samples[i], claim).model_copy(
        update={"turn_proofs": samples[i].turn_proofs[:1]}
    )
    verdict = _judge(setup, work, samples).verdict
    assert verdict is not None and not verdict.accept
    assert "cut_short" in verdict.reasons[0], verdict.reasons


def test_an_episode_with_another_seed_is_rejected(setup, honest):
    work, samples = honest
    samples = list(samples)
    episode = samples[0].episode.model_copy(update={"seed": samples[0].episode.seed + 1})
    samples[0] = samples[0].model_copy(update={"episode": episode})
    verdict = _judge(setup, work, samples).verdict
    assert verdict is not None and not verdict.accept
    assert "episode seed" in verdict.reasons[0]


def test_turn_proofs_swapped_between_calls_are_rejected(setup, honest):
    work, samples = honest
    i = next(j for j, s in enumerate(samples) if len(s.turn_proofs) >= 2)
    proofs = list(samples[i].turn_proofs)
    proofs[0], proofs[1] = proofs[1], proofs[0]
    samples = list(samples)
    samples[i] = samples[i].model_copy(update={"turn_proofs": proofs})
    verdict = _judge(setup, work, samples).verdict
    assert verdict is not None and not verdict.accept
    assert f"sample {i} turn 0" in verdict.reasons[0]


def test_a_single_turn_sample_for_a_multi_turn_task_is_rejected(setup, honest):
    work, samples = honest
    samples = [s.model_copy(update={"episode": None, "turn_proofs": None}) for s in samples]
    verdict = _judge(setup, work, samples).verdict
    assert verdict is not None and not verdict.accept
    assert "no episode" in verdict.reasons[0]


# --- what the pool refuses on arrival ---------------------------------------------------------


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: {"output_tokens": s.output_tokens[:-1], "logprobs": s.logprobs[:-1]},
         "output_tokens are not"),
        (lambda s: {"logprobs": [x - 0.5 for x in s.logprobs]}, "logprobs are not"),
        (lambda s: {"turn_proofs": s.turn_proofs + [None]}, "turn proofs for"),
        (lambda s: {"proof": s.turn_proofs[0]}, "turn_proofs, one per model call"),
        (lambda s: {"episode": s.episode.model_copy(update={"reward": 1.0})},
         "reward is the trusted side's"),
        (lambda s: {"prompt_tokens": s.prompt_tokens[1:]}, "first context"),
        (lambda s: {"episode": None}, "turn_proofs belong to an episode"),
    ],
)  # fmt: skip
def test_the_pool_refuses_an_inconsistent_episode(setup, honest, change, words):
    _, _, _, _, worker, _ = setup
    work, samples = honest
    spec = PoolSpec(
        pool_id="swarm", owner_key=worker.public_key_hex, task_count=16, samples_per_task=2,
        sampling=work.sampling,
    )  # fmt: skip
    bad = [samples[0].model_copy(update=change(samples[0])), *samples[1:]]
    with pytest.raises(Invalid, match=words):
        check_samples(spec, work, bad, 0, 1 << 20)


def test_a_model_turn_over_the_token_limit_is_refused(setup, honest):
    _, _, _, _, worker, _ = setup
    work, samples = honest
    tight = work.model_copy(
        update={"sampling": work.sampling.model_copy(update={"max_new_tokens": 1})}
    )
    spec = PoolSpec(
        pool_id="swarm", owner_key=worker.public_key_hex, task_count=16, samples_per_task=2,
        sampling=tight.sampling,
    )  # fmt: skip
    long = next(s for s in samples if max(len(c.output_tokens) for c in s.episode.calls()) > 1)
    with pytest.raises(Invalid, match="max_new_tokens"):
        check_samples(spec, tight, [long, *[s for s in samples if s is not long]], 0, 1 << 20)


# --- one replay per segment ---------------------------------------------------------------


def test_a_segments_calls_are_replayed_by_one_prefill_with_the_same_result(setup, honest):
    from swarmrl.toploc.prefill import prefill_many

    _, _, _, engine, _, _ = setup
    _, samples = honest
    pairs, keys = [], []
    for i, s in enumerate(samples):
        for call in s.episode.calls():
            pairs.append((call.prompt_tokens, call.output_tokens))
            keys.append(i)
    pairs.append(([1, 5, 6], [7, 2]))  # shares a key with sample 0's calls, extends none
    keys.append(0)
    alone = prefill_many(engine, pairs)
    shared = prefill_many(engine, pairs, shared=keys)
    forwards = []
    real = engine.backbone.forward
    engine.backbone.forward = lambda tokens, *a, **k: (
        forwards.append(tokens.shape),
        real(tokens, *a, **k),
    )[1]
    try:
        prefill_many(engine, pairs, shared=keys)
    finally:
        engine.backbone.forward = real
    rows = sum(shape[0] for shape in forwards)
    assert rows == len(samples) + 1 < len(pairs)  # one row per episode, and the odd pair alone
    for a, b in zip(alone, shared, strict=True):
        assert a.logits.shape == b.logits.shape
        assert a.hidden_states.shape == b.hidden_states.shape
        assert torch.allclose(a.logits, b.logits, atol=1e-4)
        assert torch.allclose(a.hidden_states, b.hidden_states, atol=1e-4)


# --- environments whose turns cannot be recomputed ---------------------------------------------


def test_an_environment_the_trusted_side_cannot_recompute_is_refused_in_one_line(setup):
    from swarmrl.envs.multiturn import require_recomputable
    from swarmrl.errors import ConfigError

    _, env, _, _, _, _ = setup
    require_recomputable(env)  # guess: every reply a pure function of its inputs

    class Searching(GuessEnv):  # a tool that reads the outside world
        name = "searching"
        recomputable = False

    with pytest.raises(ConfigError) as refused:
        require_recomputable(Searching())
    assert "\n" not in str(refused.value) and "--colocated" in str(refused.value)
