"""`swarmrl toploc calibrate` end to end on a saved tiny model, and loading its thresholds."""

import json

import pytest
import torch

from swarmrl.cli import main as swarmrl_main
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import MissingPathError, UserError
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import save_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.toploc.verify import load_thresholds


@pytest.mark.slow
def test_calibrate_writes_thresholds_the_verifier_loads(tmp_path):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdef:")
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model_dir = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "model")
    out = tmp_path / "thresholds.json"
    argv = ["toploc", "calibrate", "--model", str(model_dir), "--samples", "8"]
    argv += ["--batch-sizes", "1,4", "--threads", "1", "--max-new-tokens", "10"]
    assert swarmrl_main([*argv, "--out", str(out)]) == 0
    torch.set_num_threads(previous)
    document = json.loads(out.read_text())
    assert [r["cache"] for r in document["runs"]] == [True, False, True, False]
    measured = document["measured"]
    assert measured["mant_err_mean"]["count"] >= 8 and measured["sampling_margin"]["count"] == 8
    # fp32 on one machine: honest replays agree to the last bit, so the limits are tight
    thresholds = document["thresholds"]
    assert thresholds["max_mantissa_mean"] <= 1.5 and thresholds["min_exponent_matches"] > 120
    loaded = load_thresholds(ToplocConfig(thresholds_path=str(out)))
    assert loaded.max_mantissa_mean == thresholds["max_mantissa_mean"]
    assert loaded.logprob_tolerance == thresholds["logprob_tolerance"]


def test_threshold_file_errors_are_one_line_user_errors(tmp_path):
    with pytest.raises(MissingPathError):
        load_thresholds(ToplocConfig(thresholds_path=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text('{"measured": {}}')
    with pytest.raises(UserError, match="not a toploc thresholds file"):
        load_thresholds(ToplocConfig(thresholds_path=str(bad)))
    bad.write_text('{"thresholds": {"max_mantissa_mean": -1}}')
    with pytest.raises(UserError):
        load_thresholds(ToplocConfig(thresholds_path=str(bad)))
