"""The trainer under torchrun: a 2-rank FSDP2 step equals a 1-process step; bad layouts fail.

Runs real ``torchrun`` subprocesses (gloo on CPU) on a tiny Llama saved to disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.model import TinyModelConfig
from swarmrl.errors import ConfigError
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import load_policy, save_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.trainer.parallel import init_parallel

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SRC = Path(__file__).resolve().parent.parent / "src"


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 300) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(script), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+-= ")
    tiny = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = create_tiny_model(tiny, tokenizer)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("tiny") / "policy")


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation-checkpointing"])
def test_two_rank_step_equals_one_process_step(
    tiny_dir: Path, tmp_path: Path, recompute: bool
) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from sharded_step import run_step
    finally:
        sys.path.remove(str(SCRIPTS))
    run_step(str(tiny_dir), str(tmp_path / "one.pt"))
    extra = ["ac"] if recompute else []
    torchrun(2, SCRIPTS / "sharded_step.py", str(tiny_dir), str(tmp_path / "two.pt"), *extra)
    one = torch.load(tmp_path / "one.pt")
    two = torch.load(tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    start = load_policy(tiny_dir)[0].state_dict()
    assert one["state"].keys() == two["state"].keys()
    moved = 0
    for name, value in one["state"].items():
        other = two["state"][name]
        assert other.dtype == torch.float32
        assert torch.allclose(value, other, atol=1e-5, rtol=0), name
        moved += not torch.equal(value, start[name])
    assert moved == len(start)  # the step changed every tensor, the same way in both
    for key, value in one["stats"].items():
        assert two["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert one["stats"]["loss_tokens"] == 2 + 3 + 4 + 5 + 6


def test_two_rank_lora_step_equals_one_process_step(tiny_dir: Path, tmp_path: Path) -> None:
    """LoRA under FSDP2: the adapters move the same on 2 ranks as in one process; the base
    weights do not move at all."""
    pytest.importorskip("peft")
    sys.path.insert(0, str(SCRIPTS))
    try:
        from sharded_step import run_step
    finally:
        sys.path.remove(str(SCRIPTS))
    run_step(str(tiny_dir), str(tmp_path / "one.pt"), lora=True)
    torchrun(2, SCRIPTS / "sharded_step.py", str(tiny_dir), str(tmp_path / "two.pt"), "lora")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    start = load_policy(tiny_dir)[0].state_dict()
    assert one["state"].keys() == two["state"].keys()
    adapters = 0
    for name, value in one["state"].items():
        assert torch.allclose(value, two["state"][name], atol=1e-5, rtol=0), name
        if ".lora_" in name:
            adapters += 1
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(value, start[plain]), name  # the base is frozen on every rank
        assert torch.equal(two["state"][name], start[plain]), name
    assert adapters == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    for key, value in one["stats"].items():
        assert two["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_more_ranks_than_rows_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "9")
    config = SwarmConfig()
    with pytest.raises(ConfigError, match=r"trainer.nproc: 9 ranks .* only 8 rows") as err:
        init_parallel("cpu", config.trainer, 8)
    assert "\n" not in str(err.value)
