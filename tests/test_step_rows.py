"""The console follows the trainer's step rows as they are appended, and through a restart
that writes the history again (the resume test's CI failure: a row cut at the old offset)."""

import json
import os
from pathlib import Path

from swarmrl.launch.display import StepRows


def _rows(steps: range, pad: int) -> str:
    return "".join(
        json.dumps({"step": s, "update_s": 0.1 + s, "pad": "x" * pad}) + "\n" for s in steps
    )


def test_rows_are_read_as_appended_and_a_half_written_row_waits(tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    reader = StepRows(path)
    assert reader.read() == []
    path.write_text(_rows(range(2), 5))
    line = _rows(range(2, 3), 5)
    with path.open("a") as f:
        f.write(line[:10])
    assert [r["step"] for r in reader.read()] == [0, 1]
    with path.open("a") as f:
        f.write(line[10:])
    assert [r["step"] for r in reader.read()] == [0, 1, 2]
    assert [r["step"] for r in reader.read()] == [0, 1, 2]


def test_a_history_put_in_place_as_a_new_file_is_read_from_its_start(tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    path.write_text(_rows(range(4), 3))
    reader = StepRows(path)
    assert len(reader.read()) == 4
    # the restarted trainer: its checkpoint's 2 rows, then longer rows past the old offset
    scratch = tmp_path / ".steps.jsonl.tmp"
    scratch.write_text(_rows(range(2), 3) + _rows(range(2, 5), 40))
    os.replace(scratch, path)
    rows = reader.read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [len(r["pad"]) for r in rows] == [3, 3, 40, 40, 40]


def test_a_history_rewritten_in_place_under_the_offset_is_read_again(tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    path.write_text(_rows(range(4), 3))
    reader = StepRows(path)
    assert len(reader.read()) == 4
    with path.open("w") as f:  # same file, longer than before, the old offset inside a row
        f.write(_rows(range(2), 3) + _rows(range(2, 5), 40))
    assert [r["step"] for r in reader.read()] == [0, 1, 2, 3, 4]


def test_a_file_cut_shorter_is_read_again(tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    path.write_text(_rows(range(4), 3))
    reader = StepRows(path)
    reader.read()
    with path.open("w") as f:
        f.write(_rows(range(1), 3))
    assert [r["step"] for r in reader.read()] == [0]


def test_text_that_is_not_rows_shows_no_rows_rather_than_failing(tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b"\xff\xfe not json\n")
    assert StepRows(path).read() == []
