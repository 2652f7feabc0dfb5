"""The pool spec a config implies, and the check that a given spec agrees with its config.

Most keys of a :class:`PoolSpec` repeat settings every other role reads from the config: the
sampling parameters workers generate with and the trainer calibrates with, the group size, the
async level, the number of training tasks (the size of the environment's training split). A
spec written by hand drifts from them silently, so:

- :func:`spec_from_config` is the one place a spec is made from a config: ``swarmrl run`` writes
  ``RUN_DIR/pool.json`` with it, ``swarmrl pool spec CONFIG`` writes the same file for a
  deployment by hand (``docs/deploy.md``);
- :func:`check_spec` refuses, in one line naming each key, a spec that disagrees with the config
  (the orchestrator runs it at start when given both).

How each spec key follows from the config (``config_terms``)::

    task_count          size of the environment's training split (env.*)
    samples_per_task    rl.group_size
    sampling.*          rl.sampling.*
    seed                run.seed
    async_level         rl.async_level
    lease_version_lag   swarm.lease_version_lag
    validated_fraction  swarm.spot_check_floor
    check_rate_decay    swarm.spot_check_decay
    release_after_checks    swarm.spot_check_release_after
    release_young_checks    swarm.spot_check_release_young
    release_replay_fraction swarm.spot_check_release_replay
    twin_fraction       swarm.spot_check_twin
    quorum              swarm.quorum
    max_tasks_per_lease swarm.rollouts_per_lease // rl.group_size (at least 1)
    lease_timeout_s     swarm.lease_timeout_s
    evidence_drift      toploc.evidence_drift
    evidence_limit      toploc.evidence_limit
    evidence_measure_limits toploc.evidence_measure_limits
    evidence_scale      toploc.evidence_scale
    requirements.engines    toploc.engines, else inference.backend alone (the engines the
                        verifier was calibrated on; a node declaring another is refused)

The other keys (pool id, owner and validator keys, the validators' engines, ``open``, the lease
sizing and credit lock, the other requirements) are the operator's; they are written with
:data:`OPERATOR_DEFAULTS` and never compared.
Knows the config tree, the environment's split and the spec; nothing about serving a pool.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from swarmrl.config import SwarmConfig
from swarmrl.config.args import add_config_args, config_from_args
from swarmrl.errors import ConfigError, UserError
from swarmrl.protocol.pool import PoolSpec

DEFAULT_POOL_ID = "swarm"  # the pool id ``swarmrl run`` hosts and the role verbs default to

# keys of the spec that are the operator's choice, as ``swarmrl run`` sets them
OPERATOR_DEFAULTS: dict[str, Any] = {
    "open": False,
    "min_tasks_per_lease": 1,
    "lease_target_s": 5.0,
    "max_leases_in_flight": 2,  # the unit a worker answers and the next, asked for ahead
    "credit_lock_s": 3600.0,
}


def task_count(config: SwarmConfig) -> int:
    """Tasks of the pool: the size of the configured environment's training split."""
    from swarmrl.envs import build_env  # reads a dataset for math/code

    return build_env(config.env).split_size("train")


def config_terms(config: SwarmConfig, tasks: int | None) -> dict[str, tuple[str, Any]]:
    """Spec key (dotted) → (where in the config it comes from, its value); ``task_count`` only
    when ``tasks`` is known."""
    group = config.rl.group_size
    swarm = config.swarm
    terms: dict[str, tuple[str, Any]] = {}
    if tasks is not None:
        terms["task_count"] = ("the environment's training split", tasks)
    terms["samples_per_task"] = ("rl.group_size", group)
    for key, value in config.rl.sampling.model_dump().items():
        terms[f"sampling.{key}"] = (f"rl.sampling.{key}", value)
    terms["seed"] = ("run.seed", config.run.seed)
    terms["async_level"] = ("rl.async_level", config.rl.async_level)
    terms["lease_version_lag"] = ("swarm.lease_version_lag", swarm.lease_version_lag)
    terms["validated_fraction"] = ("swarm.spot_check_floor", swarm.spot_check_floor)
    terms["check_rate_decay"] = ("swarm.spot_check_decay", swarm.spot_check_decay)
    terms["release_after_checks"] = (
        "swarm.spot_check_release_after",
        swarm.spot_check_release_after,
    )
    terms["release_young_checks"] = (
        "swarm.spot_check_release_young",
        swarm.spot_check_release_young,
    )
    terms["release_replay_fraction"] = (
        "swarm.spot_check_release_replay",
        swarm.spot_check_release_replay,
    )
    terms["twin_fraction"] = ("swarm.spot_check_twin", swarm.spot_check_twin)
    terms["quorum"] = ("swarm.quorum", swarm.quorum)
    terms["max_tasks_per_lease"] = (
        "swarm.rollouts_per_lease / rl.group_size",
        max(1, swarm.rollouts_per_lease // group),
    )
    terms["lease_timeout_s"] = ("swarm.lease_timeout_s", swarm.lease_timeout_s)
    terms["evidence_drift"] = ("toploc.evidence_drift", config.toploc.evidence_drift)
    terms["evidence_limit"] = ("toploc.evidence_limit", config.toploc.evidence_limit)
    terms["evidence_measure_limits"] = (
        "toploc.evidence_measure_limits",
        dict(config.toploc.evidence_measure_limits),
    )
    terms["evidence_scale"] = ("toploc.evidence_scale", config.toploc.evidence_scale)
    terms["requirements.engines"] = (
        "toploc.engines (else inference.backend)",
        config.pool_engines,
    )
    return terms


def spec_from_config(
    config: SwarmConfig,
    owner_key: str,
    validators: list[str],
    pool_id: str = DEFAULT_POOL_ID,
    validator_engines: dict[str, str] | None = None,
) -> PoolSpec:
    """The pool a run of ``config`` trains in; keys are hex public keys. ``validator_engines``:
    the engine each validator replays on, by key (``PoolSpec.validator_engines``; the spec is
    refused where they leave an engine of ``requirements.engines`` without a validator)."""
    data: dict[str, Any] = {
        "pool_id": pool_id,
        "owner_key": owner_key,
        "validators": list(validators),
        "validator_engines": dict(validator_engines or {}),
        **OPERATOR_DEFAULTS,
    }
    for key, (_, value) in config_terms(config, task_count(config)).items():
        head, _, leaf = key.partition(".")
        if leaf:
            data.setdefault(head, {})[leaf] = value
        else:
            data[key] = value
    try:
        return PoolSpec.model_validate(data)
    except ValidationError as exc:
        raise refusal(repr(pool_id), exc) from exc


def refusal(where: str, exc: ValidationError) -> ConfigError:
    """The one-line error for a pool spec (read from ``where``) that ``PoolSpec`` refused: the
    first wrong key and why."""
    first = exc.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "spec"
    return ConfigError(
        f"pool spec {where}: {key}: {str(first['msg']).removeprefix('Value error, ')}"
    )


def write_spec(spec: PoolSpec, path: Path) -> Path:
    """``spec`` as the JSON file the orchestrator's ``--pool`` reads."""
    path.write_text(spec.model_dump_json(indent=2) + "\n")
    return path


def _value(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def disagreements(spec: PoolSpec, config: SwarmConfig, tasks: int | None) -> list[str]:
    """Each spec key whose value differs from what ``config`` implies, in words."""
    data = spec.model_dump(mode="json")
    wrong = []
    for key, (source, expected) in config_terms(config, tasks).items():
        given = _value(data, key)
        if given != expected:
            wrong.append(f"{key} = {given!r} but {source} gives {expected!r}")
    return wrong


def check_spec(spec: PoolSpec, config: SwarmConfig, where: str) -> str | None:
    """Raise a one-line :class:`ConfigError` naming every key of ``spec`` (read from ``where``)
    that disagrees with ``config``. Returns a note when ``task_count`` could not be checked
    because the environment does not build on this machine (its data is not here), else None."""
    note = None
    try:
        tasks: int | None = task_count(config)
    except UserError as exc:
        tasks = None
        why = f"the environment does not build here: {exc}"
        note = f"pool spec {where}: task_count not checked ({why})"
    wrong = disagreements(spec, config, tasks)
    if wrong:
        raise ConfigError(
            f"pool spec {where} disagrees with the config: {'; '.join(wrong)} "
            "(write the spec with `swarmrl pool spec CONFIG`)"
        )
    return note


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """``swarmrl pool spec [CONFIG] [--set …] --owner KEY [--validator KEY …]
    [--validator-engine KEY=ENGINE …] [--out FILE]``."""
    add_config_args(parser)
    parser.add_argument(
        "--owner", required=True, help="pool owner's (trainer's) public key: hex or key file"
    )
    parser.add_argument(
        "--validator",
        action="append",
        default=[],
        help="a validator's public key: hex or key file (repeatable)",
    )
    parser.add_argument(
        "--validator-engine",
        action="append",
        default=[],
        metavar="KEY=ENGINE",
        help="the engine a validator replays on (repeatable; its key is also a --validator); "
        "once one is given, every engine the pool accepts needs a validator",
    )
    parser.add_argument("--pool-id", default=DEFAULT_POOL_ID, help="pool id")
    parser.add_argument("--out", default=None, help="write the spec here (else stdout)")


def spec_main(args: argparse.Namespace) -> int:
    """Write the spec of ``args.config`` (what ``swarmrl run`` would write as pool.json)."""
    from swarmrl.identity.keys import parse_public_key

    config = config_from_args(args)
    owner = parse_public_key(args.owner)
    validators = [parse_public_key(v) for v in args.validator]
    engines = {}
    for item in args.validator_engine:
        key, sep, engine = item.rpartition("=")
        if not sep or not key or not engine:
            raise UserError(f"--validator-engine {item!r}: want KEY=ENGINE")
        engines[parse_public_key(key)] = engine
    spec = spec_from_config(config, owner, validators, args.pool_id, engines)
    if args.out is None:
        print(spec.model_dump_json(indent=2))
        return 0
    write_spec(spec, Path(args.out))
    print(f"pool spec {spec.pool_id!r} ({spec.task_count} tasks) written to {args.out}")
    return 0
