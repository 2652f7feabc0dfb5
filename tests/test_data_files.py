"""Local data files (JSON lines, a JSON array, Parquet, CSV) are read with what the core
installs; only a dataset directory or a hub id needs Hugging Face ``datasets`` (the ``tasks``
extra)."""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from swarmrl.config import load_config
from swarmrl.envs import build_env
from swarmrl.envs.data import load_records
from swarmrl.errors import ConfigError, DatasetError

REPO = Path(__file__).resolve().parents[1]
MATH_SMALL = REPO / "configs" / "data" / "math-small.jsonl"
ROWS = [{"problem": "1 + 2", "answer": "3"}, {"problem": "2 * 4", "answer": 8}]


@pytest.fixture
def no_datasets(monkeypatch):
    """``import datasets`` fails, as where the ``tasks`` extra is not installed."""
    monkeypatch.setitem(sys.modules, "datasets", None)


def test_the_shipped_math_config_builds_without_datasets(no_datasets):
    env = build_env(load_config([REPO / "configs" / "math.toml"]).env)
    assert env.split_size("train") == 360


def test_every_local_file_type_reads_without_datasets(tmp_path, no_datasets):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), tmp_path / "d.parquet")
    pyarrow.csv.write_csv(pa.Table.from_pylist(ROWS[:1]), tmp_path / "d.csv")
    assert load_records(tmp_path / "d.jsonl") == ROWS
    assert load_records(tmp_path / "d.json") == ROWS
    assert load_records(tmp_path / "d.parquet") == ROWS[:1]
    assert load_records(tmp_path / "d.csv") == [{"problem": "1 + 2", "answer": 3}]


def test_a_bad_row_is_named_without_datasets(tmp_path, no_datasets):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl row 2: expected an object, got list"):
        load_records(bad)
    (tmp_path / "b.json").write_text('{"problem": "x"')
    with pytest.raises(DatasetError, match=r"b.json row 1: not valid JSON"):
        load_records(tmp_path / "b.json")


def test_a_hub_id_without_datasets_names_the_install(no_datasets):
    with pytest.raises(ConfigError, match=r"pip install 'swarmrl\[tasks\]'"):
        load_records("someone/some-set")


def test_rows_are_the_ones_datasets_reads():
    datasets = pytest.importorskip("datasets", reason="datasets is in the 'tasks' extra")
    datasets.disable_progress_bars()
    theirs = datasets.load_dataset("json", data_files=str(MATH_SMALL), split="train")
    assert load_records(MATH_SMALL) == [dict(row) for row in theirs]


def test_a_key_a_row_lacks_reads_as_none(tmp_path, no_datasets):
    """As ``datasets`` reads it: every row has every column of the file."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "1 + 2", "answer": "3"}\n{"problem": "p"}\n')
    assert load_records(path)[1] == {"problem": "p", "answer": None}
