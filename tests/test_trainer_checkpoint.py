"""Trainer checkpoints: a resumed run continues exactly; a foreign checkpoint stops at start.

The sharded cases run real ``torchrun`` subprocesses (gloo, 2 ranks) on a tiny Llama.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from swarmrl.config import SwarmConfig
from swarmrl.errors import CheckpointMismatch
from swarmrl.trainer.checkpoint import Checkpointer
from swarmrl.trainer.parallel import Parallel
from test_trainer_parallel import SCRIPTS, tiny_dir, torchrun  # noqa: F401 (fixture)

sys.path.insert(0, str(SCRIPTS))
from sharded_resume import run as resume_script  # noqa: E402


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.allclose(value, b[name], atol=atol, rtol=0), name


def test_one_process_resume_continues_exactly(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    ckpt = tmp_path / "ckpt"
    resume_script(str(tiny_dir), str(ckpt), str(tmp_path / "straight.pt"), "save")
    resume_script(str(tiny_dir), str(ckpt), str(tmp_path / "resumed.pt"), "load")
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    _same(straight["state"], resumed["state"], atol=0)
    assert torch.equal(straight["draw"], resumed["draw"])  # the RNG came back too
    assert (ckpt / "latest").read_text().strip() == "step-000001"


def test_two_rank_resume_continues_and_reshards_to_one(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    ckpt = tmp_path / "ckpt"
    script = SCRIPTS / "sharded_resume.py"
    torchrun(2, script, str(tiny_dir), str(ckpt), str(tmp_path / "straight.pt"), "save")
    assert sorted(p.name for p in (ckpt / "step-000001").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # one shard file per rank
    torchrun(2, script, str(tiny_dir), str(ckpt), str(tmp_path / "resumed.pt"), "load")
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    _same(straight["state"], resumed["state"], atol=0)
    assert torch.equal(straight["draw"], resumed["draw"])
    # the same checkpoint loads into one process (DCP reshards) and trains on to the same place
    resume_script(str(tiny_dir), str(ckpt), str(tmp_path / "one.pt"), "load")
    _same(straight["state"], torch.load(tmp_path / "one.pt")["state"], atol=1e-5)


def test_checkpoint_of_another_config_is_a_one_line_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    Checkpointer(root, SwarmConfig(), Parallel()).save(model, optimizer, 3, 3, None)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    other = SwarmConfig.model_validate({"model": {"tiny": {"hidden_size": 64}}})
    with pytest.raises(CheckpointMismatch, match="another model or config") as err:
        Checkpointer(root, other, Parallel()).latest()
    assert "\n" not in str(err.value)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before  # nothing touched
    # more steps is the same run, continued: accepted
    longer = SwarmConfig.model_validate({"rl": {"steps": 500}})
    assert Checkpointer(root, longer, Parallel()).latest() == root / "step-000003"
