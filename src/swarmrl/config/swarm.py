"""Config of the swarm: how many of each role ``swarmrl run`` starts, and how roles wait.

Roles read the same section when started on their own machines (``swarmrl worker`` …), so the
timeouts here are the ones every role uses for its waits. Imports no torch.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from swarmrl.config.base import Section

CHEAT_PATTERN = re.compile(r"^(corrupt_weights_after|forge_env_after):(\d+)$")
CHEATS = "'corrupt_weights_after:N' or 'forge_env_after:N'"


class SwarmSection(Section):
    """The ``[swarm]`` section: settings of ``swarmrl run`` / ``swarmrl demo`` and of each role's
    waits (the root of the tree is ``swarmrl.config.SwarmConfig``)."""

    workers: int = Field(2, ge=1, description="honest inference workers started by `swarmrl run`")
    relays: int = Field(1, ge=0, description="weight relays between the origin and the workers")
    validators: int = Field(1, ge=1, description="validators started by `swarmrl run`")
    spread_engines: bool = Field(
        True,
        description="with several toploc.engines, `swarmrl run` starts validator i and worker "
        "i (cheaters after the honest workers) on engine i mod n of them, so a validator of "
        "each engine judges by that engine's own honest means (docs/toploc.md, \"Each "
        "pairing's own honest means\"; needs swarm.validators >= the number of engines); "
        "false = every role on inference.backend",
    )
    cheaters: list[str] = Field(
        default_factory=list,
        description=(
            "extra workers started by `swarmrl run` with a test-only misbehaviour each "
            "(values as for `cheat`); the demo starts one to show it is caught and banned"
        ),
    )
    cheat: str = Field(
        "",
        description=(
            "TEST-ONLY misbehaviour of this worker: '' = honest; 'corrupt_weights_after:N' = "
            "after N submissions generate with corrupted weights (proofs then fail replay); "
            "'forge_env_after:N' = after N submissions forge the environment's turns of "
            "multi-turn episodes (every number in a tool result or feedback changed; a "
            "verifiers taskset: its harness config's `lie` set); N = 0: from the first unit"
        ),
    )
    rollouts_per_lease: int = Field(
        64, gt=0, description="completions a worker asks for per lease (prompts × group size)"
    )
    lease_timeout_s: float = Field(
        60.0, gt=0, description="a leased unit not submitted within this is reassigned"
    )
    spot_check_floor: float = Field(
        0.4,
        ge=0,
        le=1,
        description=(
            "least share of a worker's submissions validators check (the pool's "
            "`validated_fraction`); unchecked ones train only after a later check of the same "
            "worker passed; 1 = check everything"
        ),
    )
    spot_check_decay: float = Field(
        0.8,
        ge=0,
        le=1,
        description=(
            "a worker's check rate is max(`spot_check_floor`, this ** checks passed since its "
            "last failed one): 1 for a new worker, back to 1 after a failure"
        ),
    )
    spot_check_release_after: int = Field(
        2,
        ge=1,
        le=1000,
        description=(
            "an unchecked submission trains once this many checks of the same worker's later "
            "submissions passed (the pool's `release_after_checks`); more holds a sparse "
            "cheater's unchecked work until it is caught, and delays an honest worker's"
        ),
    )
    spot_check_release_young: int = Field(
        0,
        ge=0,
        le=100_000,
        description=(
            "a worker with fewer passed checks than this has none of its unchecked submissions "
            "trained until it has them (the pool's `release_young_checks`); 0 = no such wait"
        ),
    )
    spot_check_release_replay: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "share of the unchecked submissions a passed check would release that validators "
            "check instead (the pool's `release_replay_fraction`); 0 = release them all"
        ),
    )
    spot_check_twin: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "share of the unchecked submissions whose unit (tasks and seed) another worker "
            "generates again (the pool's `twin_fraction`): differing outputs send both to "
            "validators, equal ones leave the unit to the usual release; none while no other "
            "worker is healthy; costs that share of workers' compute, no validator work for "
            "honest twins; 0 = none"
        ),
    )
    lease_version_lag: int = Field(
        0,
        ge=0,
        le=1000,
        description=(
            "a fresh lease may be generated on a policy this many versions older than the "
            "pool would otherwise ask for (the pool's `lease_version_lag`; never older than "
            "`rl.async_level` allows): 1 lets workers far from the trainer generate while the "
            "newest version still crosses the link"
        ),
    )
    lease_ahead: bool = Field(
        True,
        description=(
            "a worker asks for its next unit while its submission is on the way (one round "
            "trip a unit instead of two; it then holds two leases for that moment, within the "
            "pool's `max_leases_in_flight`); a `wait` answered to that request is asked again "
            "after the submission, so a pool allowing one lease loses nothing but a request"
        ),
    )
    quorum: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "validators that judge a rejected submission before it counts (more than half must "
            "reject); 1 = the first verdict is final; at most `validators`"
        ),
    )
    units_per_version: int = Field(
        16,
        ge=0,
        description=(
            "a worker submits at most this many units per policy version before pausing for a "
            "newer one (at most `version_wait_s`); 0 = never pause"
        ),
    )
    version_wait_s: float = Field(
        2.0, ge=0, description="longest pause of a worker that reached `units_per_version`"
    )
    ready_timeout_s: float = Field(
        120.0, gt=0, description="longest wait for a started role to answer its health check"
    )
    first_version_timeout_s: float = Field(
        720.0,
        gt=0,
        description=(
            "longest a worker waits for the run's first policy version, and `swarmrl run` for "
            "the trainer to publish it (workers start while the trainer warms up, which takes "
            "minutes when the warm start is not cached)"
        ),
    )
    peer_timeout_s: float = Field(
        30.0, gt=0, description="longest wait for one request to a peer before retrying"
    )
    retry_s: float = Field(1.0, gt=0, description="pause between retries after a failed request")
    give_up_s: float = Field(
        300.0, gt=0, description="a role exits with an error after its peer is gone this long"
    )
    batch_timeout_s: float = Field(
        600.0, gt=0, description="longest the trainer waits for one step's accepted rollouts"
    )
    shutdown_grace_s: float = Field(
        10.0, gt=0, description="seconds between SIGTERM and SIGKILL when stopping roles"
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="times `swarmrl run` starts a crashed role again before the run fails "
        "(a worker exiting as banned, or a role that finished, is not restarted)",
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, description="pause before a role's first restart; doubled for each next one"
    )
    status_interval_s: float = Field(
        1.0, gt=0, description="how often roles write their status file and the display redraws"
    )
    display: bool = Field(True, description="live terminal display during `swarmrl run`")
    role_threads: int = Field(1, ge=1, description="torch threads per role process on one machine")

    @field_validator("cheat")
    @classmethod
    def _cheat_known(cls, value: str) -> str:
        if value and not CHEAT_PATTERN.match(value):
            raise ValueError(f"cheat must be '' or {CHEATS}")
        return value

    @field_validator("cheaters")
    @classmethod
    def _cheaters_known(cls, values: list[str]) -> list[str]:
        for value in values:
            if not CHEAT_PATTERN.match(value):
                raise ValueError(f"cheaters entry {value!r} must be {CHEATS}")
        return values


def cheat_after(cheat: str) -> int | None:
    """Submissions an honest-looking worker makes before cheating; None = never cheats."""
    match = CHEAT_PATTERN.match(cheat)
    return int(match.group(2)) if match else None


def cheat_kind(cheat: str) -> str | None:
    """``corrupt_weights_after`` or ``forge_env_after``; None = never cheats."""
    match = CHEAT_PATTERN.match(cheat)
    return match.group(1) if match else None
