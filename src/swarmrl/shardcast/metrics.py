"""Prometheus metrics of one shardcast server (origin or relay), read from its catalog.

Each app gets its own :class:`prometheus_client.CollectorRegistry` (several servers may share a
process: tests, a trainer's origin beside a relay), with one collector that reads the catalog's
counters and version/client gauges at scrape time. Counter names are the catalog's
(``bytes_served_total``, ``upstream_corrupt_total`` …) under the ``shardcast_`` prefix.

Knows nothing about HTTP routes; the server answers ``GET /metrics`` with :func:`render`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from swarmrl.shardcast.catalog import Catalog

GAUGES = {
    "latest_version": "highest version known here (-1: none)",
    "versions_complete": "versions held in full",
    "versions_arriving": "versions whose shards are still arriving",
    "clients_reported": "clients that reported the version they hold",
    "clients_behind": "reported clients holding less than the latest version",
}


class CatalogCollector:
    """The catalog's counters and gauges, collected when Prometheus scrapes."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def _gauges(self) -> dict[str, float]:
        listing = self.catalog.version_list()
        return {
            "latest_version": listing.latest if listing.latest is not None else -1,
            "versions_complete": sum(v.complete for v in listing.versions),
            "versions_arriving": sum(not v.complete for v in listing.versions),
            "clients_reported": len(self.catalog.clients),
            "clients_behind": self.catalog.clients_behind(),
        }

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(dict(self.catalog.counters).items()):
            help_ = name.removesuffix("_total").replace("_", " ")
            yield CounterMetricFamily(f"shardcast_{name}", help_, value=value)
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(f"shardcast_{name}", GAUGES[name], value=value)


def registry_for(catalog: Catalog) -> CollectorRegistry:
    """A registry of its own holding one collector over ``catalog``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CatalogCollector(catalog))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
