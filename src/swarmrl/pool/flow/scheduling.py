"""Pure scheduling maths: the per-node task draw, unit seeds, lease sizing, throughput estimate.

Task draw (a node can neither choose nor foresee its tasks; anyone can recompute them once the
epoch's secret is revealed), with the project's one seeding rule
(``swarmrl.protocol.seeds.derive_seed``)::

    task_i = derive_seed("task", pool_seed, secret, node_id, counter, i) mod task_count

for i in 0 … n−1, where ``counter`` is the node's lease counter in that pool (0, 1, 2, …) and
``secret`` the orchestrator's assignment secret of the epoch the lease was drawn in (hex,
committed in the ledger beforehand and revealed later: ``swarmrl.pool.trust.assignments``). Draws
are with replacement; the modulo bias is below 2^-40 for any task count under 2^23.

Unit seed: ``derive_seed("unit", pool_seed, secret, node_id, counter)``.

Lease size: ``clamp(floor(tokens_per_s · target_s / (samples_per_task · max_new_tokens)), lo, hi)``
tasks, using the orchestrator's own throughput estimate; a node without one gets ``lo``.

Throughput estimate: exponential moving average ``e ← (1 − α)·e + α·x`` with α = 0.3 over
``x = output tokens submitted / seconds from lease to submission``.
"""

from __future__ import annotations

import math

from swarmrl.protocol.seeds import derive_seed


def draw_tasks(
    pool_seed: int, secret: str, node_id: str, counter: int, n: int, task_count: int
) -> list[int]:
    """The ``n`` task indices of lease number ``counter`` of ``node_id`` (module docstring)."""
    if task_count <= 0 or n < 0:
        raise ValueError(f"need task_count > 0 and n ≥ 0, got {task_count}, {n}")
    return [
        derive_seed("task", pool_seed, secret, node_id, counter, i) % task_count for i in range(n)
    ]


def unit_seed(pool_seed: int, secret: str, node_id: str, counter: int) -> int:
    """63-bit sampling seed of one work unit."""
    return derive_seed("unit", pool_seed, secret, node_id, counter)


def lease_size(
    tokens_per_s: float | None,
    target_s: float,
    samples_per_task: int,
    max_new_tokens: int,
    lo: int,
    hi: int,
) -> int:
    """Tasks in the next lease of a node with throughput ``tokens_per_s`` (None = unknown)."""
    if tokens_per_s is None or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
        return lo
    fit = math.floor(tokens_per_s * target_s / (samples_per_task * max_new_tokens))
    return max(lo, min(hi, fit))


def update_throughput(
    previous: float | None, tokens: int, seconds: float, alpha: float = 0.3
) -> float:
    """EMA of tokens per second; the first observation is taken as is."""
    observed = tokens / max(seconds, 1e-3)
    return observed if previous is None else (1 - alpha) * previous + alpha * observed
