"""TorchEngine against plain transformers forward passes on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from swarmrl.config.model import TinyModelConfig
from swarmrl.inference import TorchEngine
from swarmrl.inference.backbone import HFBackbone
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.protocol import SamplingParams

TOKENIZER = build_char_tokenizer("0123456789+-*= ")
PROMPTS = [[1, 5, 6, 18, 7], [1, 9], [1, 4, 4, 4, 4, 4, 4, 4, 5, 17], [1, 13, 12]]


def _model(arch: str = "llama", seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return create_tiny_model(TinyModelConfig(arch=arch, num_layers=2), TOKENIZER)


def _gqa_model(arch: str) -> PreTrainedModel:
    """4 query heads sharing 2 kv heads; Qwen2 biases set non-zero so their fusion is tested."""
    common = dict(
        vocab_size=len(TOKENIZER),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.eval()


def _hf_forward(model: PreTrainedModel, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain transformers pass without cache: (logits [S, vocab], final hidden [S, hidden])."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), out.hidden_states[-1][0].float()


def test_hf_last_hidden_state_is_post_final_norm() -> None:
    model = _model()
    logits, hidden = _hf_forward(model, PROMPTS[0])
    assert torch.allclose(model.lm_head(hidden), logits, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_forward_equals_transformers_on_ragged_batch(arch: str) -> None:
    model = _gqa_model(arch)
    engine = TorchEngine(model, TOKENIZER)
    assert engine.fast_path
    rows = [p + [7, 8, 9] for p in PROMPTS]
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]).bool()
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden, logits = engine.backbone.forward(tokens, positions, valid, None, 0, "all")
    for b, row in enumerate(rows):
        ref_logits, ref_hidden = _hf_forward(model, row)
        assert torch.allclose(logits[b, width - len(row) :], ref_logits, atol=1e-5)
        assert torch.allclose(hidden[b, width - len(row) :], ref_hidden, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gqa-llama", "gqa-qwen2"])
def test_generation_logprobs_and_hidden_match_a_full_forward(arch: str) -> None:
    model = _gqa_model(arch[4:]) if arch.startswith("gqa") else _model(arch)
    engine = TorchEngine(model, TOKENIZER)
    params = SamplingParams(temperature=0.7, max_new_tokens=12)
    gens = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], return_hidden=True)
    for gen in gens:
        p, n = len(gen.prompt_tokens), len(gen.output_tokens)
        logits, hidden = _hf_forward(model, gen.prompt_tokens + gen.output_tokens[:-1])
        ref = torch.log_softmax(logits[p - 1 :] / 0.7, -1)
        ref = ref.gather(1, torch.tensor(gen.output_tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4)
        assert gen.hidden_states is not None and gen.hidden_states.shape == (
            p + n - 1,
            hidden.shape[1],
        )
        assert gen.hidden_states.dtype == torch.float32
        assert torch.allclose(gen.hidden_states, hidden, atol=1e-4)


def test_same_seeds_give_same_tokens_in_any_batch() -> None:
    engine = TorchEngine(_model(), TOKENIZER)
    params = SamplingParams(max_new_tokens=10)
    together = engine.generate(PROMPTS, params, seeds=[10, 11, 12, 13])
    reversed_ = engine.generate(PROMPTS[::-1], params, seeds=[13, 12, 11, 10])[::-1]
    alone = [
        engine.generate([p], params, seeds=[s])[0]
        for p, s in zip(PROMPTS, [10, 11, 12, 13], strict=True)
    ]
    for a, b, c in zip(together, reversed_, alone, strict=True):
        assert a.output_tokens == b.output_tokens == c.output_tokens
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-5)
    other = engine.generate(PROMPTS, params, seeds=[20, 21, 22, 23])
    assert [g.output_tokens for g in other] != [g.output_tokens for g in together]


def test_top_k_restricts_every_generated_token() -> None:
    model = _model()
    engine = TorchEngine(model, TOKENIZER)
    gens = engine.generate(PROMPTS, SamplingParams(top_k=3, max_new_tokens=8), seeds=[5, 6, 7, 8])
    for gen in gens:
        logits, _ = _hf_forward(model, gen.prompt_tokens + gen.output_tokens[:-1])
        rows = logits[len(gen.prompt_tokens) - 1 :]
        top = torch.topk(rows, 3, dim=-1)
        for j, tok in enumerate(gen.output_tokens):
            assert tok in top.indices[j].tolist()
            expected = torch.log_softmax(top.values[j], -1)[top.indices[j].tolist().index(tok)]
            assert abs(gen.logprobs[j] - expected.item()) < 1e-4


def test_stops_on_eos_and_on_length() -> None:
    model = _model()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = TorchEngine(model, None).generate([PROMPTS[0]], greedy, seeds=[0])[0]
    assert free.finish_reason == "length" and len(free.output_tokens) == 12
    stop = free.output_tokens[3]
    first = free.output_tokens.index(stop)
    model.config.eos_token_id = stop
    ended = TorchEngine(model, None).generate([PROMPTS[0]], greedy, seeds=[0])[0]
    assert ended.finish_reason == "eos"
    assert ended.output_tokens == free.output_tokens[: first + 1]
    model.config.eos_token_id = None
    by_param = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    again = TorchEngine(model, None).generate([PROMPTS[0]], by_param, seeds=[0])[0]
    assert again.output_tokens == ended.output_tokens and again.finish_reason == "eos"


def test_rows_stop_independently_and_hidden_lengths_follow() -> None:
    engine = TorchEngine(_model(), TOKENIZER)
    gens = engine.generate(
        PROMPTS * 4, SamplingParams(max_new_tokens=20), seeds=range(16), return_hidden=True
    )
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"eos", "length"}
    for g in gens:
        assert (g.output_tokens[-1] == TOKENIZER.eos_token_id) == (g.finish_reason == "eos")
        assert TOKENIZER.eos_token_id not in g.output_tokens[:-1]
        assert len(g.logprobs) == len(g.output_tokens)
        assert g.hidden_states.shape[0] == len(g.prompt_tokens) + len(g.output_tokens) - 1
    # rows that stop early leave the batch; the others must not notice
    for i in (0, 5, 10, 15):
        alone = engine.generate(
            [gens[i].prompt_tokens],
            SamplingParams(max_new_tokens=20),
            seeds=[i],
            return_hidden=True,
        )[0]
        assert alone.output_tokens == gens[i].output_tokens
        assert torch.allclose(alone.hidden_states, gens[i].hidden_states, atol=1e-5)


def test_prefill_reproduces_generation() -> None:
    model = _model("qwen2")
    engine = TorchEngine(model, TOKENIZER)
    greedy = engine.generate(
        PROMPTS,
        SamplingParams(temperature=0.0, max_new_tokens=9),
        seeds=[0] * 4,
        return_hidden=True,
    )
    for gen in greedy:
        pre = engine.prefill(gen.prompt_tokens, gen.output_tokens)
        n = len(gen.output_tokens)
        assert pre.logits.shape == (n, len(TOKENIZER)) and pre.logits.dtype == torch.float32
        assert pre.logits.argmax(-1).tolist() == gen.output_tokens
        lp = torch.log_softmax(pre.logits, -1).gather(1, torch.tensor(gen.output_tokens)[:, None])[
            :, 0
        ]
        assert torch.allclose(lp, torch.tensor(gen.logprobs), atol=1e-5)
        assert torch.allclose(pre.hidden_states, gen.hidden_states, atol=1e-5)
    with pytest.raises(ValueError):
        engine.prefill(PROMPTS[0], [])


def test_transformers_fallback_matches_fast_path() -> None:
    model = _model()
    fast = TorchEngine(model, TOKENIZER)
    slow = TorchEngine(model, TOKENIZER)
    slow.backbone = HFBackbone(model)
    params = SamplingParams(max_new_tokens=8, top_p=0.9)
    a = fast.generate(PROMPTS, params, seeds=[1, 2, 3, 4], return_hidden=True)
    b = slow.generate(PROMPTS, params, seeds=[1, 2, 3, 4], return_hidden=True)
    for x, y in zip(a, b, strict=True):
        assert x.output_tokens == y.output_tokens
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
        assert torch.allclose(x.hidden_states, y.hidden_states, atol=1e-5)
    pa, pb = (
        fast.prefill(PROMPTS[2], a[2].output_tokens),
        slow.prefill(PROMPTS[2], a[2].output_tokens),
    )
    assert torch.allclose(pa.logits, pb.logits, atol=1e-5)


def test_other_architectures_run_through_transformers() -> None:
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=len(TOKENIZER),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    model = MistralForCausalLM(cfg).eval()
    engine = TorchEngine(model, TOKENIZER)
    assert not engine.fast_path
    gen = engine.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_new_tokens=5), seeds=[3, 4])[
        1
    ]
    logits, _ = _hf_forward(model, gen.prompt_tokens + gen.output_tokens[:-1])
    ref = torch.log_softmax(logits[len(gen.prompt_tokens) - 1 :], -1)
    ref = ref.gather(1, torch.tensor(gen.output_tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4)


def test_load_state_dict_swaps_the_policy() -> None:
    old, new = _model(seed=0), _model(seed=1)
    params = SamplingParams(max_new_tokens=8)
    engine = TorchEngine(old, TOKENIZER)
    before = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    engine.load_state_dict(new.state_dict())
    after = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    expected = TorchEngine(_model(seed=1), TOKENIZER).generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert [g.output_tokens for g in after] == [g.output_tokens for g in expected]
    assert [g.output_tokens for g in after] != [g.output_tokens for g in before]
    with pytest.raises(ValueError):
        engine.load_state_dict({"model.norm.weight": torch.ones(128)})


def test_weights_changed_behind_the_engine_are_picked_up() -> None:
    model = _model(seed=0)
    engine = TorchEngine(model, TOKENIZER)
    params = SamplingParams(max_new_tokens=8)
    expected = TorchEngine(_model(seed=1), TOKENIZER).generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    model.load_state_dict(_model(seed=1).state_dict(), assign=True)  # new tensors, not copies
    after = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert [g.output_tokens for g in after] == [g.output_tokens for g in expected]
    with torch.no_grad():  # an optimizer-style in-place update reaches the fused weights too
        model.model.layers[0].self_attn.q_proj.weight.mul_(3.0)
    logits, _ = _hf_forward(model, PROMPTS[0] + [5])
    pre = engine.prefill(PROMPTS[0], [5, 6])
    assert torch.allclose(pre.logits, logits[len(PROMPTS[0]) - 1 :], atol=1e-5)


def test_bad_inputs_are_rejected() -> None:
    engine = TorchEngine(_model(), TOKENIZER)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError):
        engine.generate([[1, 2]], params, seeds=[1, 2])
    with pytest.raises(ValueError):
        engine.generate([[1, 999]], params, seeds=[1])
    with pytest.raises(ValueError):
        engine.generate([[]], params, seeds=[1])
    assert engine.generate([], params, seeds=[]) == []


def test_bfloat16_model_runs_and_reports_float32() -> None:
    model = _model("qwen2").to(torch.bfloat16)
    engine = TorchEngine(model, TOKENIZER)
    gen = engine.generate(
        PROMPTS[:2], SamplingParams(max_new_tokens=6), seeds=[1, 2], return_hidden=True
    )[1]
    assert gen.hidden_states is not None and gen.hidden_states.dtype == torch.float32
    logits, hidden = _hf_forward(model, gen.prompt_tokens + gen.output_tokens[:-1])
    ref = torch.log_softmax(logits[len(gen.prompt_tokens) - 1 :], -1)
    ref = ref.gather(1, torch.tensor(gen.output_tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=0.05)
    assert torch.allclose(gen.hidden_states, hidden, atol=0.1)


def test_a_checkpoint_of_the_models_own_tensors_loads_without_building_a_model(
    tmp_path, monkeypatch
) -> None:
    """A new version's ``model.safetensors`` (tied output head absent) is read straight into
    the engine; a file that does not match the model's tensors goes through transformers."""
    from transformers import AutoModelForCausalLM

    from swarmrl.model import save_policy

    save_policy(_model(seed=1), TOKENIZER, tmp_path / "v1")
    engine = TorchEngine(_model(seed=0), TOKENIZER)
    built = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: built.append(a) or real(*a, **k),
    )
    engine.load_checkpoint(tmp_path / "v1")
    assert built == []
    want = TorchEngine.from_checkpoint(tmp_path / "v1")
    params = SamplingParams(max_new_tokens=8)
    ours = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4], return_hidden=True)
    theirs = want.generate(PROMPTS, params, seeds=[1, 2, 3, 4], return_hidden=True)
    assert [g.output_tokens for g in ours] == [g.output_tokens for g in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.hidden_states, b.hidden_states)
    built.clear()
    other = create_tiny_model(TinyModelConfig(num_layers=3), TOKENIZER)  # one layer more
    save_policy(other, TOKENIZER, tmp_path / "v2")
    with pytest.raises(ValueError):  # not this architecture: transformers' load, then refused
        engine.load_checkpoint(tmp_path / "v2")
    assert len(built) == 1
