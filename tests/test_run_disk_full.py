"""A ``swarmrl run`` whose disk fills up mid-run ends ``failed`` with the reason in report.json,
and leaves no empty files behind.

The run directory lies on a size-capped tmpfs mounted for the test (root only: skipped where
mounting is not permitted); once the trainer has trained three steps, the test fills what is left
of it, as another program writing to the same disk would. Every role is a real process.
"""

from __future__ import annotations

import errno
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmrl.errors import SwarmError
from swarmrl.launch.swarm import run_swarm
from swarmrl.protocol.swarm import RoleStatus
from test_swarm_e2e import _config, cache_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

DISK_MB = 96


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A DISK_MB tmpfs mounted at ``tmp_path/disk`` for the test's duration."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip() or made.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> int:
    """Write zeros to ``path`` until the disk is full; the bytes written."""
    block, written = b"\0" * (1 << 20), 0
    with open(path, "wb", buffering=0) as out:
        while True:
            try:
                written += out.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        try:  # the last partial block
            while True:
                written += out.write(b"\0" * 4096)
        except OSError:
            pass
    return written


def test_a_full_disk_ends_the_run_failed_with_its_reason_and_no_empty_files(
    small_disk: Path,
    cache_dir: Path,  # noqa: F811
) -> None:
    config = _config(cache_dir, "rl.steps=12", "swarm.workers=1", "swarm.status_interval_s=0.2")
    run_dir = small_disk / "run"
    filled: dict[str, int] = {}
    done = threading.Event()

    def fill_mid_run() -> None:
        while not done.is_set():
            trainer = RoleStatus.read_dir(run_dir / "status").get("trainer")
            if trainer is not None and trainer.metrics.get("step", 0) >= 3:
                filled["bytes"] = _fill(small_disk / "someone-elses-file")
                return
            time.sleep(0.05)

    filler = threading.Thread(target=fill_mid_run, daemon=True)
    filler.start()
    try:
        with pytest.raises(SwarmError) as failure:
            run_swarm(config, run_dir, display=False, timeout_s=600)
    finally:
        done.set()
        filler.join()

    assert filled, "the run ended before the disk was filled"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "failed"
    reason = report["reason"]
    # one line, the one the console prints (after "swarmrl run: "), naming the full disk
    # whichever role or write met it first
    assert "\n" not in reason and f"the disk holding {run_dir} is full" in reason, reason
    assert reason == f"DiskWriteError: {str(failure.value).splitlines()[0]}"
    assert report["steps"] >= 2  # what finished before the disk filled is still reported
    empty = [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.is_file() and p.stat().st_size == 0
    ]
    assert empty == [], empty


def test_a_ledger_export_onto_a_full_disk_leaves_no_file_behind(small_disk: Path) -> None:
    """The export a run writes at its end (``ledger.jsonl``): on a full disk it fails with the
    disk's error and leaves neither an empty nor a half-written file."""
    from swarmrl.ledger.export import write_entries

    _fill(small_disk / "someone-elses-file")
    entry = {"seq": 0, "ts": 0.0, "kind": "k", "pool_id": "p", "node_id": None, "body": {"x": 1},
             "prev_hash": "0" * 64, "entry_hash": "1" * 64, "signature": "2" * 128}  # fmt: skip
    with pytest.raises(OSError) as full:
        write_entries([entry] * 2000, small_disk / "run" / "ledger.jsonl")
    assert full.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (small_disk / "run").iterdir()) == []
