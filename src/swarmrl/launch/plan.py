"""The plan of a local swarm: the run directory, its keys, invites, pool spec and config, and the
name, engine and address of every role, before any role starts (``prepare``).

Layout of a run directory::

    keys/        one ed25519 key file per role (trainer = pool owner, orchestrator, validators,
                 workers); invites/ one single-use invite per worker, signed by the owner
    pool.json    the pool spec the orchestrator hosts
    toploc-thresholds.json   verifier thresholds the trainer calibrated on the starting policy
                 (model and dtype) before publishing version 0; the validators use them
    logs/        one log file per role            status/  one status file per role
    orchestrator/  database (ledger) and rollout files
    trainer/     the origin's version store and the trainer's summary
    relay-N/, worker-N/, validator-N/   each role's weight cache
    report.json, ledger.jsonl

Knows nothing about starting or watching roles (``swarmrl.launch.swarm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from swarmrl.config import SwarmConfig, save_config
from swarmrl.config.model import looks_local, model_dir
from swarmrl.config.toploc import THRESHOLDS_FILE
from swarmrl.errors import ConfigError
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.launch.facts import POOL_ID
from swarmrl.rolekit.supervisor import free_port

HOST = "127.0.0.1"


@dataclass
class SwarmPlan:
    """Names, files and addresses of every role of one local swarm."""

    config: SwarmConfig
    run_dir: Path
    config_file: Path
    workers: list[str] = field(default_factory=list)
    cheats: dict[str, str] = field(default_factory=dict)
    validators: list[str] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)  # a role on another engine than
    # inference.backend (swarm.spread_engines)
    relays: list[str] = field(default_factory=list)
    orchestrator_port: int = 0
    origin_port: int = 0
    relay_ports: dict[str, int] = field(default_factory=dict)
    pool_id: str = POOL_ID

    def key(self, name: str) -> Path:
        return self.run_dir / "keys" / f"{name}.key"

    def orchestrator_public_key(self) -> str:
        """The key the orchestrator signs the ledger with (hex)."""
        return load_keypair(self.key("orchestrator")).public_key_hex

    @property
    def orchestrator_url(self) -> str:
        return f"http://{HOST}:{self.orchestrator_port}"

    @property
    def origin_url(self) -> str:
        return f"http://{HOST}:{self.origin_port}"

    def relay_url(self, name: str) -> str:
        return f"http://{HOST}:{self.relay_ports[name]}"

    @property
    def weight_sources(self) -> list[str]:
        """Relays first; the origin last as the fallback."""
        return [self.relay_url(r) for r in self.relays] + [self.origin_url]

    @property
    def status_dir(self) -> Path:
        return self.run_dir / "status"


def prepare(config: SwarmConfig, run_dir: Path, config_file: Path | None = None) -> SwarmPlan:
    """Write keys, invites, the pool spec and the resolved config into ``run_dir``. A local
    ``model.path`` without a model fails here, before any role starts (every role would
    otherwise start, import its libraries and fail on it alike)."""
    from swarmrl.pool.invites import make_invite
    from swarmrl.pool.spec_check import spec_from_config, write_spec

    swarm = config.swarm
    workers = [f"worker-{i}" for i in range(swarm.workers + len(swarm.cheaters))]
    validators = [f"validator-{i}" for i in range(swarm.validators)]
    engines = spread_engines(config, validators, workers)  # refused before any file is written
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.model.path is not None and looks_local(config.model.path):
        model_dir(config.model.path)
    if config.toploc.thresholds_path is None and config.toploc.calibrate_at_start:
        # the trainer calibrates the starting policy there before version 0 is published
        recorded = str((run_dir / THRESHOLDS_FILE).resolve())
        toploc = config.toploc.model_copy(update={"thresholds_path": recorded})
        config = config.model_copy(update={"toploc": toploc})
    save_config(config, run_dir)
    plan = SwarmPlan(config, run_dir, config_file or run_dir / "config.toml")
    if config_file is None:
        write_config_toml(config, plan.config_file)
    plan.workers, plan.validators, plan.engines = workers, validators, engines
    plan.cheats = {plan.workers[swarm.workers + i]: c for i, c in enumerate(swarm.cheaters)}
    plan.relays = [f"relay-{i}" for i in range(swarm.relays)]
    keys: dict[str, KeyPair] = {}
    for name in ["trainer", "orchestrator", *plan.validators, *plan.workers]:
        path = plan.key(name)
        keys[name] = load_keypair(path) if path.is_file() else _new_key(path)
    validators = [keys[v].public_key_hex for v in plan.validators]
    spread = len(config.pool_engines) < 2 or config.swarm.spread_engines
    validator_engines = {  # each validator's engine is the spec's (not said where not spread)
        keys[v].public_key_hex: engines.get(v, config.inference.backend) for v in plan.validators
    }
    spec = spec_from_config(
        config,
        keys["trainer"].public_key_hex,
        validators,
        POOL_ID,
        validator_engines if spread else None,
    )
    write_spec(spec, run_dir / "pool.json")  # as `swarmrl pool spec` writes it
    invites = run_dir / "invites"
    invites.mkdir(exist_ok=True)
    for name in plan.workers:
        invite = make_invite(keys["trainer"], POOL_ID, 86400.0, keys[name].node_id)
        (invites / f"{name}.json").write_text(invite.model_dump_json(indent=2) + "\n")
    plan.orchestrator_port = free_port()
    plan.origin_port = free_port()
    plan.relay_ports = {name: free_port() for name in plan.relays}
    return plan


def spread_engines(
    config: SwarmConfig, validators: list[str], workers: list[str]
) -> dict[str, str]:
    """The engine of each validator and worker that does not run ``inference.backend``: with
    several engines in the pool and ``swarm.spread_engines``, role i of each kind runs engine
    i mod n, so every engine has a validator that judges its workers by its own honest means
    (a validator of another engine judges them by the cross-engine means only)."""
    engines = config.pool_engines
    if len(engines) < 2 or not config.swarm.spread_engines:
        return {}
    if len(validators) < len(engines):
        raise ConfigError(
            f"swarm.validators = {len(validators)} but toploc.engines names {len(engines)} "
            f"engines ({', '.join(engines)}): start a validator on each (swarm.validators >= "
            f"{len(engines)}), or swarm.spread_engines = false to run every role on "
            "inference.backend"
        )
    spread = {}
    for names in (validators, workers):
        for i, name in enumerate(names):
            if engines[i % len(engines)] != config.inference.backend:
                spread[name] = engines[i % len(engines)]
    return spread


def _new_key(path: Path) -> KeyPair:
    pair = KeyPair.generate()
    pair.save(path)
    return pair


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: a key left out reads back as its default, which is what None means."""
    return {
        k: _drop_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None
    }


def write_config_toml(config: SwarmConfig, path: Path) -> Path:
    """The resolved config as TOML, so every role reads exactly the same settings."""
    path.write_text(tomli_w.dumps(_drop_none(config.model_dump(mode="json"))))
    return path
