"""Every verb takes ``[CONFIG] --set section.key=value`` the same way, and light roles stay light.

Unknown keys fail in one line that names the key, whatever the verb; the relay and the
orchestrator build their apps without importing torch, transformers or matplotlib (checked in a
fresh interpreter, where nothing else could have imported them first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from swarmrl.cli import main as cli_main
from swarmrl.identity import KeyPair

PEERS = [
    "--orchestrator", "http://127.0.0.1:9",
    "--weights", "http://127.0.0.1:9",
    "--publisher-key", "00" * 32,
]  # fmt: skip

VERBS = {
    "orchestrator": ["--key", "{key}"],
    "relay": ["--upstream", "http://127.0.0.1:9", "--publisher-key", "00" * 32, "--store", "{d}"],
    "worker": ["--key", "{key}", *PEERS],
    "validator": ["--key", "{key}", *PEERS],
    "trainer": ["--key", "{key}", "--orchestrator", "http://127.0.0.1:9", "--run-dir", "{d}"],
    "shardcast publish": ["{d}", "--key", "{key}", "--store", "{d}"],
    "shardcast fetch": [
        "--source",
        "http://127.0.0.1:9",
        "--out",
        "{d}",
        "--publisher-key",
        "{key}",
    ],
    "shardcast serve-origin": ["--store", "{d}"],
}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(
    "override, needle",
    [
        ("pool.bogus_key=1", "unknown config key 'pool.bogus_key'"),
        ("shardcast.keep_versions=0", "'shardcast.keep_versions'"),
        ("nosuchsection.x=1", "unknown config key 'nosuchsection'"),
    ],
)
def test_every_verb_rejects_bad_keys_in_one_line(verb, override, needle, tmp_path, capsys):
    key = tmp_path / "key.json"
    KeyPair.generate().save(key)
    words = verb.split()
    args = [a.format(key=key, d=tmp_path) for a in VERBS[verb]]
    assert cli_main([*words, *args, "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_reads_a_config_file(verb, tmp_path, capsys):
    key = tmp_path / "key.json"
    KeyPair.generate().save(key)
    bad = tmp_path / "run.toml"
    bad.write_text("[shardcast]\nkeep_versions = 2\n[toploc]\nno_such_knob = 1\n")
    words = verb.split()
    args = [a.format(key=key, d=tmp_path) for a in VERBS[verb]]
    args.insert(1 if verb == "shardcast publish" else 0, str(bad))  # after CHECKPOINT_DIR
    assert cli_main([*words, *args]) == 2
    assert "unknown config key 'toploc.no_such_knob'" in capsys.readouterr().err


LIGHT = textwrap.dedent(
    """
    import argparse, json, sys
    from swarmrl.config.args import config_from_args
    from swarmrl.identity import KeyPair
    from swarmrl.roles.orchestrator import cli as orchestrator
    from swarmrl.roles.relay import cli as relay
    from swarmrl.pool.web.app import build_app
    from swarmrl.pool.server import make_context

    d = sys.argv[1]
    args = relay._parser().parse_args(
        ["--upstream", "http://127.0.0.1:9", "--publisher-key", "00" * 32, "--store", d]
    )
    relay.build(args, config_from_args(args))
    args = orchestrator._parser().parse_args(["--key", "unused", "--run-dir", d])
    build_app(make_context(KeyPair.generate(), d, orchestrator.pool_config(args)))
    heavy = ("torch", "transformers", "matplotlib")
    print(json.dumps([m for m in sys.modules if m.split(".")[0] in heavy]))
    """
)


def test_relay_and_orchestrator_start_without_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", LIGHT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
