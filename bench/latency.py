"""Latency figures of ``bench/pool.py``: percentiles, and a per-second timeline of a window
(requests started in each second, their p50/p99/max) with its plot. Knows nothing about the
pool or how the requests were made."""

from __future__ import annotations

from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the value at rank ⌊q·n⌋ of n sorted), NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms_at(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds) in milliseconds, to 0.1 ms (q = 1: the max)."""
    return round(percentile(values, q) * 1000, 1)


def timeline(moments: list[tuple[float, float]], seconds: int) -> list[dict[str, float]]:
    """Per second of the window: requests started in it, and their p50, p99 and max latency
    (ms). Shows whether a p99 comes from a few stalls (every request of a second late) or from
    a backlog built by bursts of arrivals."""
    by_second: list[list[float]] = [[] for _ in range(seconds)]
    for at, latency in moments:
        if 0 <= at < seconds:
            by_second[int(at)].append(latency)
    return [
        {
            "s": i,
            "n": len(v),
            "p50_ms": ms_at(v, 0.5),
            "p99_ms": ms_at(v, 0.99),
            "max_ms": ms_at(v, 1.0),
        }
        for i, v in enumerate(by_second)
    ]


def plot_timeline(rows: list[dict], path: Path) -> None:
    """Requests started and their latency per second of each level's window, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 3.2 * len(rows)), squeeze=False)
    for ax, row in zip(axes[:, 0], rows, strict=True):
        t = [x["s"] for x in row["timeline"]]
        ax.bar(t, [x["n"] for x in row["timeline"]], color="#c8d6e5", label="requests started")
        ax.set_ylabel("requests / s")
        ax.set_xlabel("seconds into the window")
        lat = ax.twinx()
        lat.plot(t, [x["p99_ms"] for x in row["timeline"]], color="#c0392b", label="p99")
        lat.plot(t, [x["p50_ms"] for x in row["timeline"]], color="#2e86de", label="p50")
        lat.set_ylabel("latency (ms)")
        lat.legend(loc="upper right")
        ax.set_title(f"{row['nodes']} nodes: p99 {row['p99_ms']} ms, {row['req_per_s']} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
