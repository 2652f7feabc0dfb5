"""Tokenizer, tiny-model factory and HF-directory round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmrl.config.model import TinyModelConfig
from swarmrl.errors import MissingPathError
from swarmrl.model import build_char_tokenizer, create_tiny_model, load_policy, save_policy

ALPHABET = "0123456789+-*= \n"


def test_tokenizer_maps_each_character_and_decodes_without_spaces() -> None:
    tok = build_char_tokenizer(ALPHABET)
    ids = tok.encode("12+34=\n46", add_special_tokens=False)
    assert len(ids) == 9
    assert tok.decode(ids) == "12+34=\n46"
    assert len(tok) == 4 + len(ALPHABET)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    with_special = [tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_special, skip_special_tokens=True) == "12+34=\n46"
    assert tok.encode("x", add_special_tokens=False) == [tok.unk_token_id]


def test_tokenizer_round_trips_through_files(tmp_path: Path) -> None:
    tok = build_char_tokenizer(ALPHABET)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "9*9=81 "
    assert again.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    assert again.decode(tok.encode(text, add_special_tokens=False)) == text
    assert again.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_shape_and_tied_embeddings(arch: str) -> None:
    tok = build_char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    model = create_tiny_model(TinyModelConfig(arch=arch), tok)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tok))
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_tiny_model_is_seeded_by_caller() -> None:
    tok = build_char_tokenizer(ALPHABET)
    torch.manual_seed(3)
    a = create_tiny_model(TinyModelConfig(), tok)
    torch.manual_seed(3)
    b = create_tiny_model(TinyModelConfig(), tok)
    torch.manual_seed(4)
    c = create_tiny_model(TinyModelConfig(), tok)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_and_load_policy_round_trip(tmp_path: Path, arch: str) -> None:
    tok = build_char_tokenizer(ALPHABET)
    torch.manual_seed(1)
    model = create_tiny_model(TinyModelConfig(arch=arch, num_layers=2), tok)
    out = save_policy(model, tok, tmp_path / "policy")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded, loaded_tok = load_policy(out)
    ids = torch.tensor([tok.encode("12+3=", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok.decode(ids[0].tolist()) == "12+3="
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(plain.model.norm.weight, model.model.norm.weight)


def test_load_policy_in_bfloat16(tmp_path: Path) -> None:
    tok = build_char_tokenizer(ALPHABET)
    save_policy(create_tiny_model(TinyModelConfig(num_layers=1), tok), tok, tmp_path)
    model, _ = load_policy(tmp_path, dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_load_policy_missing_dir_is_one_line_user_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(MissingPathError) as err:
        load_policy(missing)
    assert "\n" not in str(err.value)
    assert str(missing) in str(err.value)
    with pytest.raises(MissingPathError):
        load_policy("./relative/not/there")


def test_load_policy_unreachable_hub_id_is_one_line_user_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub.constants

    # offline: the lookup fails at once instead of retrying a network that tests never use
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(MissingPathError) as err:
        load_policy("swarmrl-no-such-org/no-such-model")
    assert "\n" not in str(err.value)
    assert "swarmrl-no-such-org/no-such-model" in str(err.value)


def test_a_tokenizer_that_cannot_encode_a_prompt_is_refused_at_start(tmp_path: Path) -> None:
    """A digits-only tokenizer given a letters task: one ConfigError naming the characters,
    before any step, instead of training on <unk> tokens."""
    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.envs import build_env
    from swarmrl.errors import ConfigError
    from swarmrl.model.prompts import check_prompts_encodable
    from swarmrl.trainer.learner import Learner

    digits = build_char_tokenizer("0123456789+=")
    check_prompts_encodable(digits, ["12+34=", "7="])  # covered: no error
    with pytest.raises(ConfigError, match=r"cannot encode 'x'"):
        check_prompts_encodable(digits, ["12+x="])

    model_dir = save_policy(
        create_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, intermediate_size=32),
                          digits),
        digits,
        tmp_path / "digits-model",
    )  # fmt: skip
    config = load_config([EMBEDDED_DEFAULT], ["env.name=reverse", f"model.path={str(model_dir)!r}"])
    with pytest.raises(ConfigError, match="cannot encode"):
        Learner(config, build_env(config.env))


def test_saving_onto_a_full_disk_is_one_error_and_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer saving a version when the disk is full: a one-line DiskWriteError (the CLI
    prints it as one line), and no half-written checkpoint directory left to be mistaken."""
    import errno

    from swarmrl.errors import DiskWriteError

    tokenizer = build_char_tokenizer("0123456789")
    model = create_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, intermediate_size=32),
                              tokenizer)  # fmt: skip

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(DiskWriteError, match="No space left on device"):
        save_policy(model, tokenizer, tmp_path / "v3")
    assert not (tmp_path / "v3").exists()
