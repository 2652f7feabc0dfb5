"""The ``swarmrl`` command's front door: the key reference, one-line errors, pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from swarmrl.cli import main
from swarmrl.config.reference import show_markdown

REPO = Path(__file__).resolve().parents[1]


def _swarmrl(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def test_config_show_prints_every_key_with_value_default_and_description(capsys):
    assert main(["config", "show", "--set", "rl.steps=7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = next(line for line in lines if line.startswith("rl.steps = "))
    assert steps.startswith("rl.steps = 7 (default ")
    assert "#" in steps and steps.split("#", 1)[1].strip()
    keys = {line.split(" = ", 1)[0] for line in lines}
    assert {"pool.request_window_s", "shardcast.keep_versions", "toploc.topk"} <= keys


def test_config_show_refuses_an_unknown_key_in_one_line():
    result = _swarmrl("config", "show", "--set", "rl.no_such_key=1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "swarmrl config: error: unknown config key 'rl.no_such_key'"
    ]


def test_docs_config_page_is_current():
    """docs/config.md is generated; regenerate with `swarmrl config show --markdown`."""
    assert (REPO / "docs" / "config.md").read_text() == show_markdown()


def test_a_closed_pipe_is_not_a_traceback():
    """``swarmrl … | head -1``: the reader leaves early; the command ends quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = _swarmrl("config", "show", stdout=write_end)
    finally:
        os.close(write_end)
    assert result.returncode == 0
    assert "Traceback" not in result.stderr


def test_an_invite_for_a_malformed_node_id_is_a_one_line_error(tmp_path):
    key = tmp_path / "owner.json"
    assert _swarmrl("keys", "new", "--out", str(key)).returncode == 0
    result = _swarmrl("pool", "invite", "--key", str(key), "--pool", "p", "--node", "zzz")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarmrl pool: error: invite node_id 'zzz'")


def test_a_port_in_use_is_a_one_line_error(tmp_path):
    """Orchestrator and relay on a port someone else holds: one line, exit 2, no traceback."""
    import socket

    key = tmp_path / "k.json"
    assert _swarmrl("keys", "new", "--out", str(key)).returncode == 0
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        runs = {
            "orchestrator": _swarmrl(
                "orchestrator", "--key", str(key), "--port", port, "--run-dir", str(tmp_path / "o")
            ),
            "relay": _swarmrl(
                "relay",
                "--upstream",
                "http://127.0.0.1:9",
                "--publisher-key",
                str(key),
                "--store",
                str(tmp_path / "r"),
                "--port",
                port,
            ),  # fmt: skip
        }
    for verb, result in runs.items():
        assert result.returncode == 2, (verb, result.stderr)
        assert "Traceback" not in result.stderr, verb
        assert (
            f"swarmrl {verb}: error: cannot listen on 127.0.0.1:{port}: the port is in use"
            in (result.stderr.strip().splitlines()[-1])
        )


def test_every_verb_helps_at_once_and_alike():
    """``swarmrl VERB --help`` imports no torch, transformers or matplotlib (so it answers at
    once), shows no RST markup, and every verb that reads the config describes --set alike."""
    from swarmrl.cli import VERBS

    probe = (
        "import contextlib, io, sys\n"
        "from swarmrl.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main([sys.argv[1], '--help'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules)\n"
        "print(repr(heavy)); print(out.getvalue())\n"
    )
    for verb in VERBS:
        result = subprocess.run(
            [sys.executable, "-c", probe, verb], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, (verb, result.stderr)
        heavy, _, text = result.stdout.partition("\n")
        assert heavy == "[]", f"swarmrl {verb} --help imports {heavy}"
        assert f"usage: swarmrl {verb}" in text, verb
        assert "``" not in text, f"swarmrl {verb} --help shows RST markup"
        if "--set" in text:
            assert "SECTION.KEY=VALUE" in text, f"swarmrl {verb} describes --set differently"


def test_a_run_under_torchrun_is_refused_before_any_run_directory(tmp_path, monkeypatch, capsys):
    """Two ranks of `swarmrl run --colocated` would be two independent runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = str(REPO / "configs" / "arith.toml")
    for argv in (["run", config, "--colocated"], ["run", config], ["demo"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "WORLD_SIZE=2" in err and "trainer.nproc=2" in err
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["run", config, "--set", "rl.bogus=1"]) == 2  # one rank: the verb runs
    assert "unknown config key" in capsys.readouterr().err


def test_torchrun_with_two_ranks_writes_no_run_directory(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = None
    cmd = [sys.executable, "-m", "torch.distributed.run"] if torchrun is None else [str(torchrun)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [*cmd, "--standalone", "--nproc-per-node", "2", "-m", "swarmrl.cli", "run",
         str(REPO / "configs" / "arith.toml"), "--colocated", "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "every rank would start a run of its own" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_the_logged_config_line_holds_only_what_differs_from_the_defaults():
    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.config.args import config_line

    line = config_line(load_config([EMBEDDED_DEFAULT], ["rl.steps=3", "pool.db_url=sqlite:///x"]))
    assert len(line) < 200
    data = json.loads(line)
    assert data["rl"] == {"steps": 3} and data["pool"] == {"db_url": "<set>"}
    assert "toploc" not in data and "shardcast" not in data


def test_role_arguments_are_checked_before_the_first_log_line(tmp_path):
    """A refused role prints its one error line, not a config line before it."""
    key = tmp_path / "k.key"
    assert main(["keys", "new", "--out", str(key)]) == 0
    config = str(REPO / "configs" / "arith.toml")
    refusals = {
        "invite file not found": _swarmrl(
            "worker", config, "--key", str(key), "--invite", str(tmp_path / "no.json"),
            "--orchestrator", "http://127.0.0.1:9", "--publisher-key", str(key),
            "--weights", "http://127.0.0.1:9",
        ),
        "pool spec not found": _swarmrl(
            "orchestrator", config, "--key", str(key), "--pool", str(tmp_path / "no.json"),
            "--run-dir", str(tmp_path / "o"),
        ),
        "neither 64 hex characters nor a key file": _swarmrl(
            "relay", config, "--upstream", "http://127.0.0.1:9", "--publisher-key", "nokey",
            "--store", str(tmp_path / "r"),
        ),
    }  # fmt: skip
    for needle, result in refusals.items():
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[:500]
        assert needle in lines[0]
