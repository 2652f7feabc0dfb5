"""docs/deploy.md's worked example, run: its commands and its pool.json against what the code
writes, so the page cannot drift from the code.

The commands are taken from the page's code blocks (``host$ swarmrl …``, continuation lines
joined), the page's placeholders (``my.toml``, ``7a3f…``) replaced by real files and keys.
"""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from swarmrl import cli
from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.identity import load_keypair
from swarmrl.launch.plan import prepare
from swarmrl.pool.cli import read_spec
from swarmrl.pool.spec_check import check_spec
from swarmrl.testing.deploy import fill_placeholder

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
# the verbs whose parsers the page's command lines must satisfy
PARSED = {
    "orchestrator": "swarmrl.roles.orchestrator.cli",
    "trainer": "swarmrl.roles.trainer.cli",
    "relay": "swarmrl.roles.relay.cli",
    "validator": "swarmrl.roles.validator.cli",
    "worker": "swarmrl.roles.worker.cli",
    "report": "swarmrl.launch.handrun",
}


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of the page."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def page_commands() -> list[list[str]]:
    """Every ``host$ swarmrl …`` command of the page, as argv after ``swarmrl``."""
    commands = []
    for _, body in _blocks(PAGE.read_text()):
        joined = re.sub(r"\\\n\s*", "", body)
        for line in joined.splitlines():
            match = re.match(r"^[\w.-]+\$\s+swarmrl\s+(.*?)\s*(#.*)?$", line)
            if match:
                commands.append(shlex.split(match.group(1)))
    return commands


def page_pool_json() -> dict:
    """The pool.json the page shows."""
    found = [body for lang, body in _blocks(PAGE.read_text()) if lang == "json"]
    assert len(found) == 1, "the page should show one pool.json"
    return json.loads(found[0])


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder standing for every host of the example: my.toml is the shipped demo config,
    keys made by the page's own `swarmrl keys new` commands."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(EMBEDDED_DEFAULT, tmp_path / "my.toml")
    made = set()
    for argv in page_commands():
        if argv[:2] == ["keys", "new"] and argv[-1] not in made:
            assert cli.main(argv) == 0
            made.add(argv[-1])
    keys = {name: load_keypair(tmp_path / name) for name in made}
    assert {"trainer.key", "validator.key", "orchestrator.key", "worker.key"} <= set(keys)
    placeholders = {
        "7a3f…": keys["trainer.key"].public_key_hex,
        "c41d…": keys["validator.key"].public_key_hex,
        "0bac…": keys["orchestrator.key"].public_key_hex,
        "5e0c…": keys["worker.key"].node_id,
        "9d21…": keys["worker.key"].node_id,
    }
    return tmp_path, placeholders


def _fill(argv: list[str], placeholders: dict[str, str]) -> list[str]:
    return [fill_placeholder(arg, placeholders) for arg in argv]


def test_the_pages_pool_spec_command_writes_the_pages_pool_json(site, capsys):
    folder, placeholders = site
    [argv] = [a for a in page_commands() if a[:2] == ["pool", "spec"]]
    assert cli.main(_fill(argv, placeholders)) == 0
    written = json.loads((folder / "pool.json").read_text())
    shown = page_pool_json()
    shown["owner_key"] = placeholders[shown["owner_key"]]
    shown["validators"] = [placeholders[v] for v in shown["validators"]]
    shown["validator_engines"] = {placeholders[k]: e for k, e in shown["validator_engines"].items()}
    assert written == shown
    assert check_spec(read_spec("pool.json"), load_config(["my.toml"]), "pool.json") is None


def test_the_pages_invite_commands_run(site):
    _, placeholders = site
    invites = [a for a in page_commands() if a[:2] == ["pool", "invite"]]
    assert len(invites) == 2
    for argv in invites:
        assert cli.main(_fill(argv, placeholders)) == 0
        assert json.loads(Path(argv[-1]).read_text())["pool_id"] == "swarm"


@pytest.mark.parametrize("verb", sorted(PARSED))
def test_the_pages_role_commands_parse(verb):
    """Every flag the page gives a role exists and takes the value written there."""
    import importlib

    parser = importlib.import_module(PARSED[verb])._parser()
    lines = [argv for argv in page_commands() if argv[0] == verb]
    assert lines, f"the page shows no `swarmrl {verb}` command"
    for argv in lines:
        parser.parse_args(argv[1:])


def test_the_orchestrator_refuses_a_spec_that_disagrees_with_its_config(site, capsys):
    """The spec this page used to show (max_new_tokens 8, validated_fraction 1.0, 4 tasks per
    lease) against configs/arith.toml: one line naming each key, before anything starts."""
    folder, placeholders = site
    old = {
        "pool_id": "swarm", "owner_key": placeholders["7a3f…"], "open": False,
        "validators": [placeholders["c41d…"]], "task_count": 729000, "samples_per_task": 8,
        "seed": 0, "async_level": 2,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8},
        "validated_fraction": 1.0, "min_tasks_per_lease": 1, "max_tasks_per_lease": 4,
        "lease_target_s": 5.0, "lease_timeout_s": 60.0, "max_leases_in_flight": 1,
    }  # fmt: skip
    (folder / "old.json").write_text(json.dumps(old))
    [argv] = [a for a in page_commands() if a[0] == "orchestrator"]
    argv = _fill(argv, placeholders)
    argv[argv.index("--pool") + 1] = "old.json"
    argv[argv.index("--run-dir") + 1] = "srv/orchestrator"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("swarmrl orchestrator: error: pool spec old.json disagrees")
    for key in (
        "sampling.max_new_tokens = 8",
        "validated_fraction = 1.0",
        "check_rate_decay = 0.9",
        "max_tasks_per_lease = 4",
    ):
        assert key in err
    assert "task_count" not in err and "samples_per_task" not in err
    assert not (folder / "srv").exists()  # refused before its run directory was made


def test_swarmrl_run_writes_the_spec_that_pool_spec_writes(tmp_path, monkeypatch):
    """`swarmrl run`'s pool.json is byte for byte what `swarmrl pool spec` writes for the
    same config and keys (the page says so)."""
    monkeypatch.chdir(tmp_path)
    config = load_config([EMBEDDED_DEFAULT], ["swarm.validators=2", "rl.group_size=4"])
    run_dir = tmp_path / "run"
    prepare(config, run_dir)
    argv = ["pool", "spec", str(EMBEDDED_DEFAULT), "--set", "swarm.validators=2"]
    argv += ["--set", "rl.group_size=4", "--owner", str(run_dir / "keys" / "trainer.key")]
    for name in ("validator-0", "validator-1"):
        argv += ["--validator", str(run_dir / "keys" / f"{name}.key")]
        argv += ["--validator-engine", f"{run_dir / 'keys' / f'{name}.key'}=torch"]
    assert cli.main([*argv, "--out", "spec.json"]) == 0
    assert (tmp_path / "spec.json").read_bytes() == (run_dir / "pool.json").read_bytes()
