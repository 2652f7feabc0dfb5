"""The repository as a newcomer meets it: the files its metadata names exist, and running the
tests leaves nothing behind in the directory they were started from."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_files_named_in_pyproject_exist():
    text = (REPO / "pyproject.toml").read_text()
    named = set(re.findall(r"\b(Makefile|\.ci/[\w.-]+|docs/[\w.-]+)", text))
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert missing == [], f"pyproject.toml names files that do not exist: {missing}"


def test_a_hypothesis_test_leaves_no_folder_where_pytest_ran(tmp_path):
    """Hypothesis' example database goes to the user cache, not ``.hypothesis/`` here."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    work = tmp_path / "work"
    work.mkdir()
    test = REPO / "tests" / "test_shardcast.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={REPO}",
         f"{test}::test_delta_roundtrip_any_bytes"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    assert not (work / ".hypothesis").exists()
    assert (tmp_path / "cache" / "swarmrl" / "hypothesis").is_dir()
