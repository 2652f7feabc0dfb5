"""Config of the pool subsystem: the orchestrator service's limits and timings.

Per-pool settings (tasks, sampling, async level, lease sizes, validators) travel in
``swarmrl.protocol.pool.PoolSpec`` because pools are created at run time; this section holds what
one orchestrator process applies to every pool it hosts.
"""

from __future__ import annotations

from pydantic import Field

from swarmrl.config.base import Section, path_key


class PoolConfig(Section):
    """Settings of `swarmrl.pool` (the orchestrator service)."""

    db_url: str = Field("", description="SQLAlchemy URL; empty = SQLite in the run directory")
    store_url: str = Field(
        "",
        description="rollout store dir or fsspec URL; empty = run dir",
        json_schema_extra=path_key("path or URL"),
    )
    request_window_s: float = Field(
        60.0, gt=0, description="oldest accepted signed request, s (its nonce is kept this long)"
    )
    request_future_skew_s: float = Field(
        5.0, ge=0, description="accepted clock skew of a signed request ahead of ours, s"
    )
    max_body_bytes: int = Field(8 << 20, gt=0, description="largest request body, bytes")
    max_proof_bytes: int = Field(256 << 10, gt=0, description="largest proof bundle, bytes")
    max_log_line_chars: int = Field(1000, gt=0, description="longer log lines are cut")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="how often nodes should beat")
    unhealthy_after_s: float = Field(15.0, gt=0, description="no beat this long → unhealthy")
    dead_after_s: float = Field(60.0, gt=0, description="no beat this long → dead, leases freed")
    eject_after_s: float = Field(300.0, gt=0, description="no beat this long → ejected")
    sweep_interval_s: float = Field(1.0, gt=0, description="health/lease sweeper period")
    heartbeat_flush_s: float = Field(
        1.0,
        ge=0,
        description="heartbeats that leave a node's state as it was are written to the database "
        "in one batch this often, s (a crash loses at most this much liveness, never accepted "
        "work); 0 = each at once",
    )
    full_gc_every_s: float = Field(
        3600.0,
        ge=0,
        description="the orchestrator runs Python's full garbage collection this often, s, "
        "instead of whenever Python decides (swarmrl.serving.FullCollections); 0 = Python's own",
    )
    hot_routes: bool = Field(
        True,
        description="heartbeats, leases and submissions are answered without FastAPI's routing "
        "and dependency solving (swarmrl.pool.web.hotroutes); false = by their FastAPI routes "
        "(and no direct lane)",
    )
    direct_lane: bool = Field(
        True,
        description="the hot routes are answered straight from uvicorn's parser, in one socket "
        "write (swarmrl.protocol.fastlane); false = through the ASGI app",
    )
    fast_sql: bool = Field(
        True,
        description="the hot routes' statements are handed to SQLite's driver directly "
        "(swarmrl.fastsql); false = every statement through SQLAlchemy",
    )
    claim_timeout_s: float = Field(300.0, gt=0, description="validator claim expires, s")
    cross_engine_after_s: float = Field(
        30.0,
        ge=0,
        description="a unit from a node of one engine waits this long for a validator of that "
        "engine (one that claimed within claim_timeout_s) before a validator of another engine "
        "may claim it, s (swarmrl.pool.flow.judging); 0 = any validator at once, own engine "
        "first",
    )
    join_rate_per_s: float = Field(
        2.0, gt=0, description="new nodes admitted per second and pool, on average"
    )
    join_burst: int = Field(32, gt=0, description="new nodes a pool admits at once")
    probation_submissions: int = Field(
        3,
        ge=0,
        description="a node's credit stays held until this many of its spot checks passed "
        "(pools with validators; a new node is checked at rate 1, see `swarm.spot_check_decay`)",
    )
    batch_lease_s: float = Field(
        300.0, gt=0, description="an unacknowledged trainer batch returns to the queue after, s"
    )
    admission: bool = Field(
        True,
        description="lease only what the trainer can train while fresh (swarmrl.pool.flow.admission); "
        "false = lease whenever a node asks",
    )
    admission_validation_backlog_steps: float = Field(
        2.0,
        gt=0,
        description="stop leasing while this many trainer steps' worth of tasks await a validator",
    )
    admission_trainable_backlog_steps: float = Field(
        2.0,
        gt=0,
        description="stop leasing while this many trainer steps' worth of accepted tasks wait "
        "for the trainer",
    )
    admission_retry_s: float = Field(
        0.5, gt=0, description="a node told to wait by admission control asks again after, s"
    )
