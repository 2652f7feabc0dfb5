"""One run TOML reaches every role process: each applies the sections it reads.

The launcher hands every role the run's resolved config file; the orchestrator and the relays
answer with their settings on ``/health``, the other roles log the resolved config they run
with. A value left at its default would not tell a dropped setting from an applied one, so each
section a role reads gets a non-default value here.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import tomli_w

from swarmrl.config import EMBEDDED_DEFAULT, SwarmConfig, load_config
from swarmrl.config.load import read_toml
from swarmrl.identity.keys import load_keypair
from swarmrl.launch.plan import prepare
from swarmrl.launch.swarm import start_all
from swarmrl.rolekit.supervisor import Supervisor, wait_until

pytestmark = pytest.mark.slow

# non-default in every section a role reads; the rest keeps the swarm tiny and quick to start
RUN = {
    "pool": {"heartbeat_interval_s": 2.5, "unhealthy_after_s": 11.0, "max_log_line_chars": 777},
    "shardcast": {"keep_versions": 3, "long_poll_timeout_s": 7.0, "parallel_downloads": 5},
    "toploc": {"chunk_size": 16, "logprob_tolerance": 0.02},
    "swarm": {
        "workers": 1,
        "peer_timeout_s": 17.0,
        "retry_s": 0.7,
        "shutdown_grace_s": 5.0,
    },
    "env": {"digits": 1},
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
    "sft": {"steps": 2, "batch_size": 16},
    "rl": {"steps": 1, "prompts_per_step": 2, "group_size": 2},
    "eval": {"n": 4, "control": False},
}
DEFAULTS = SwarmConfig()


def _run_toml(tmp_path: Path) -> Path:
    data = read_toml(EMBEDDED_DEFAULT)
    for section, values in RUN.items():
        data.setdefault(section, {}).update(values)
    data["run"]["cache_dir"] = str(tmp_path / "cache")
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def _logged_config(log: Path) -> dict | None:
    """The resolved config a role logged at start, or None while it has not yet."""
    if not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if "resolved config " in line:
            return json.loads(line.split("resolved config ", 1)[1])
    return None


def _assert_applied(section: str, applied: dict, who: str) -> None:
    for key, value in RUN[section].items():
        assert getattr(getattr(DEFAULTS, section), key) != value, f"{section}.{key} is a default"
        assert applied[key] == value, f"{who} applies {section}.{key}={applied[key]!r}"


def test_every_role_applies_the_run_toml(tmp_path):
    config = load_config([_run_toml(tmp_path)])
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)
    with Supervisor(run_dir, 5) as sup:
        start_all(sup, plan)
        orchestrator = httpx.get(f"{plan.orchestrator_url}/health", timeout=5).json()
        _assert_applied("pool", orchestrator["config"], "orchestrator /health")
        for name, url in [("origin", plan.origin_url)] + [
            (r, plan.relay_url(r)) for r in plan.relays
        ]:
            health = httpx.get(f"{url}/health", timeout=5).json()
            _assert_applied("shardcast", health["config"], f"{name} /health")
        logged: dict[str, dict] = {}
        for name in sup.roles:
            log = sup.log_dir / f"{name}.log"
            wait_until(
                lambda log=log: _logged_config(log) is not None,
                f"{name} to log its resolved config",
                config.swarm.ready_timeout_s,
            )
            logged[name] = _logged_config(log)
    assert set(logged) == {"orchestrator", "trainer", "relay-0", "validator-0", "worker-0"}
    for name, resolved in logged.items():
        for section in ("pool", "shardcast", "toploc", "swarm"):
            _assert_applied(section, resolved[section], f"{name}'s log")


def test_workers_and_validators_start_while_the_trainer_warms_up(tmp_path):
    """They are started before version 0 is published (their start overlaps the trainer's
    warm start instead of delaying step 0), wait for it, and the run still trains."""
    config = load_config([_run_toml(tmp_path)])
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)
    seen_while_waiting: list[set[str]] = []

    def on_wait() -> None:
        if not seen_while_waiting:  # the first look for version 0
            seen_while_waiting.append(set(sup.roles))

    with Supervisor(run_dir, 5) as sup:
        start_all(sup, plan, on_wait)
        assert seen_while_waiting, "start_all never waited for version 0"
        early = seen_while_waiting[0]
        for name in plan.relays + plan.validators + plan.workers:
            assert name in early, f"{name} was started only after version 0 was published"
        trainer = sup.roles["trainer"]
        wait_until(lambda: not trainer.alive(), "the trainer to finish its step", 300)
        assert trainer.popen.returncode == 0, trainer.log_tail()
        summary = json.loads((run_dir / "trainer" / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["consumed_submissions"], "no worker's rollouts were trained"


def test_a_pool_of_several_engines_runs_a_validator_and_workers_on_each(tmp_path):
    """With ``toploc.engines = ["torch", "vllm"]`` `swarmrl run` starts validator i and worker
    i on engine i mod 2 (each role told by ``--set inference.backend``), so each engine's units
    meet a validator of their own engine; too few validators are refused before any file is
    written, and ``swarm.spread_engines = false`` keeps every role on ``inference.backend``."""
    from swarmrl.errors import ConfigError
    from swarmrl.launch.swarm import _engine_args

    both = ['toploc.engines=["torch","vllm"]', "run.cache_dir=" + str(tmp_path / "cache")]
    alone = load_config([EMBEDDED_DEFAULT], [*both, "swarm.validators=1"])
    with pytest.raises(ConfigError, match=r"swarm.validators = 1 .* 2 engines \(torch, vllm\)"):
        prepare(alone, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    config = load_config(
        [EMBEDDED_DEFAULT], [*both, "swarm.validators=3", "swarm.workers=2", "swarm.cheaters=[]"]
    )
    plan = prepare(config, tmp_path / "run")
    assert plan.engines == {"validator-1": "vllm", "worker-1": "vllm"}
    assert _engine_args(plan, "worker-1") == ["--set", "inference.backend=vllm"]
    assert _engine_args(plan, "validator-0") == _engine_args(plan, "validator-2") == []
    spec = json.loads((tmp_path / "run" / "pool.json").read_text())
    assert spec["requirements"]["engines"] == ["torch", "vllm"]
    # the spec says each validator's engine, so the pool refuses a claim naming another
    keys = {v: load_keypair(plan.key(v)).public_key_hex for v in plan.validators}
    assert spec["validator_engines"] == {
        keys["validator-0"]: "torch", keys["validator-1"]: "vllm", keys["validator-2"]: "torch"
    }  # fmt: skip
    one_engine = config.model_copy(
        update={"swarm": config.swarm.model_copy(update={"spread_engines": False})}
    )
    assert prepare(one_engine, tmp_path / "run2").engines == {}
    # every role on torch in a pool that accepts vLLM too: the spec does not say (no coverage)
    assert json.loads((tmp_path / "run2" / "pool.json").read_text())["validator_engines"] == {}
