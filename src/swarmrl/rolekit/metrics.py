"""Prometheus metrics of a trainer, worker or validator process, read from its status report.

A role already keeps its numbers in a :class:`~swarmrl.rolekit.toolkit.StatusReporter`;
:class:`StatusCollector` turns them into Prometheus metrics at scrape time, so the status file,
the live display and Prometheus always agree. Names are ``swarmrl_<role>_<key>``: a key the role
only ever adds to (``StatusReporter.add``) is a counter (``…_total``), any other a gauge; labelled
counters (``StatusReporter.count``) keep their labels. Two more per role:
``swarmrl_<role>_policy_version`` (-1: none yet) and ``swarmrl_<role>_info`` (name, state).
Every name is listed in docs/observability.md.

:func:`serve_metrics` starts ``prometheus_client``'s own HTTP server on a daemon thread (the
worker and validator have no other server). Knows nothing about what the numbers mean.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from swarmrl.errors import UserError

if TYPE_CHECKING:
    from swarmrl.rolekit.toolkit import StatusReporter

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(role: str, key: str) -> str:
    """``swarmrl_<role>_<key>`` with anything Prometheus refuses turned into ``_``."""
    return _UNSAFE.sub("_", f"swarmrl_{role}_{key}")


class StatusCollector:
    """One role's status numbers as Prometheus metrics, collected when scraped."""

    def __init__(self, reporter: StatusReporter) -> None:
        self.reporter = reporter

    def collect(self) -> Iterator[Metric]:
        snap = self.reporter.snapshot()
        role = snap.status.role
        for key, value in sorted(snap.status.metrics.items()):
            if "." in key:  # per-node numbers (``accepted.<node id>``) are for the status file
                continue
            if key in snap.counters:
                yield CounterMetricFamily(metric_name(role, key), f"{role} {key}", value=value)
            else:
                yield GaugeMetricFamily(metric_name(role, key), f"{role} {key}", value=value)
        families: dict[str, CounterMetricFamily] = {}
        for (name, labels), value in sorted(snap.labelled.items()):
            keys = [k for k, _ in labels]
            family = families.get(name)
            if family is None:
                family = CounterMetricFamily(metric_name(role, name), f"{role} {name}", labels=keys)
                families[name] = family
            family.add_metric([v for _, v in labels], value)
        yield from families.values()
        version = snap.status.policy_version
        yield GaugeMetricFamily(
            metric_name(role, "policy_version"),
            "policy version this role holds (trainer: last published); -1: none yet",
            value=-1 if version is None else version,
        )
        info = InfoMetricFamily(f"swarmrl_{role}", "name and state of this role")
        info.add_metric([], {"name": snap.status.name, "state": snap.status.state[:80]})
        yield info


def registry_for(reporter: StatusReporter) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(reporter))
    return registry


def serve_metrics(reporter: StatusReporter, host: str, port: int) -> str:
    """Serve ``/metrics`` for ``reporter`` on ``host:port`` (0: a free port); returns the URL."""
    try:
        server, _ = start_http_server(port, host, registry_for(reporter))
    except OSError as exc:
        raise UserError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    url = f"http://{host}:{server.server_port}/metrics"
    reporter.set_metrics_url(url)
    return url


def serve_role_metrics(
    reporter: StatusReporter, args: argparse.Namespace, log: logging.Logger
) -> str | None:
    """Serve metrics when ``--metrics-port`` was given (``add_role_args``); returns the URL."""
    if args.metrics_port is None:
        return None
    url = serve_metrics(reporter, args.metrics_host, args.metrics_port)
    log.info("Prometheus metrics at %s", url)
    return url
