"""Prometheus metrics of the orchestrator: pool state read from the database at scrape time,
and the latency of every request it answers.

Per pool (label ``pool``): ``swarmrl_pool_nodes{state}``, ``swarmrl_pool_leases_active``,
``swarmrl_pool_submissions{status}`` (submissions now in each status: pending, accepted,
rejected …), ``swarmrl_pool_submission_counts{count}`` (taken_in, checked, accepted, rejected,
expired, invalidated, trained so far: the words of ``swarmrl.ledger.counts``),
``swarmrl_pool_validators{engine}`` and ``swarmrl_pool_engine_nodes{engine}`` (validators that
claimed lately, live members, by engine), ``swarmrl_pool_engine_without_validator{engine}`` (1 for
an engine whose members' units only another engine's validators judge),
``swarmrl_pool_policy_version``, ``swarmrl_pool_credited_tokens`` and
``swarmrl_pool_locked_tokens``; ``swarmrl_pool_lease_answers_total{pool, outcome, rule}`` (the
lease requests this process answered: work, wait or finished, and for a wait the rule that held
the node back, its reason with the figures left out: ``swarmrl.protocol.pool.reason_kind``); per
route: the histogram
``swarmrl_orchestrator_request_seconds{method, route, status}`` (``route`` is the path template,
``/pools/{pool_id}/lease``, so node ids never become labels). Each app has its own registry.

Knows nothing about the rules behind the numbers (``swarmrl.pool.trust.service``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from swarmrl.ledger.export import LedgerTally
from swarmrl.pool.trust import service, views
from swarmrl.pool.trust.service import Context
from swarmrl.protocol.pool import LeaseReply, reason_kind

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class PoolCollector:
    """Every hosted pool's node, lease, submission and credit counts."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tally = LedgerTally(ctx.engine)

    def collect(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily("swarmrl_pool_nodes", "nodes by state", labels=["pool", "state"])
        subs = GaugeMetricFamily(
            "swarmrl_pool_submissions", "submissions by status", labels=["pool", "status"]
        )
        counts = GaugeMetricFamily(
            "swarmrl_pool_submission_counts",
            "submissions taken in, checked, accepted, rejected, expired, invalidated, trained "
            "(docs/observability.md)",
            labels=["pool", "count"],
        )
        validators = GaugeMetricFamily(
            "swarmrl_pool_validators",
            "validators that claimed within the claim timeout, by the engine they replay on",
            labels=["pool", "engine"],
        )
        engine_nodes = GaugeMetricFamily(
            "swarmrl_pool_engine_nodes",
            "live members (healthy, unhealthy) by the engine they declared",
            labels=["pool", "engine"],
        )
        unvalidated = GaugeMetricFamily(
            "swarmrl_pool_engine_without_validator",
            "1 for an engine of live members that no validator named within the claim timeout "
            "while another engine's did (its units are judged cross-engine)",
            labels=["pool", "engine"],
        )
        scalars = {
            "leases_active": "leases handed out and not yet done or expired",
            "policy_version": "policy version the trainer last announced",
            "credited_tokens": "validator-measured tokens credited, not dropped",
            "locked_tokens": "credited tokens still inside the lock window",
        }
        gauges = {
            k: GaugeMetricFamily(f"swarmrl_pool_{k}", h, labels=["pool"])
            for k, h in scalars.items()
        }
        for info in service.list_pools(self.ctx):
            pool_id = info.spec.pool_id
            m = views.metrics(self.ctx, pool_id)
            for state, n in sorted(m.nodes_by_state.items()):
                nodes.add_metric([pool_id, state], n)
            for status, n in sorted(m.submissions_by_status.items()):
                subs.add_metric([pool_id, status], n)
            for engine, n in m.validators_by_engine.items():
                validators.add_metric([pool_id, engine], n)
            for engine, n in m.nodes_by_engine.items():
                engine_nodes.add_metric([pool_id, engine], n)
            for engine in m.engines_without_validator:
                unvalidated.add_metric([pool_id, engine], 1)
            counted = self.tally.counts(pool_id)
            counted.trained = m.submissions_by_status.get("trained", 0)
            for word, n in counted.as_dict().items():
                counts.add_metric([pool_id, word], n)
            values = {
                "leases_active": m.leases_active,
                "policy_version": m.current_version,
                "credited_tokens": m.credited_tokens,
                "locked_tokens": m.locked_tokens,
            }
            for key, value in values.items():
                gauges[key].add_metric([pool_id], value)
        yield nodes
        yield subs
        yield counts
        yield validators
        yield engine_nodes
        yield unvalidated
        yield from gauges.values()


class OrchestratorMetrics:
    """The registry of one orchestrator app and its request-latency histogram."""

    def __init__(self, ctx: Context) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PoolCollector(ctx))
        self.latency = Histogram(
            "swarmrl_orchestrator_request_seconds",
            "time to answer a request, by route template and status",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lease_answers = Counter(
            "swarmrl_pool_lease_answers",
            "lease requests answered, by outcome and, for a wait, the rule that held the node "
            "back (its reason with the figures left out)",
            ["pool", "outcome", "rule"],
            registry=self.registry,
        )

    def lease_answered(self, pool_id: str, reply: LeaseReply) -> None:
        rule = reason_kind(reply.reason) if reply.outcome == "wait" else ""
        self.lease_answers.labels(pool_id, reply.outcome, rule).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """ASGI middleware: observe each HTTP request's duration under its route template."""

    def __init__(self, app: Any, metrics: OrchestratorMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.latency.labels(scope["method"], template, str(status[0])).observe(
                time.perf_counter() - started
            )
