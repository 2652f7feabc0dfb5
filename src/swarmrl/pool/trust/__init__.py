"""Who takes part in a pool and how far each is trusted.

``service`` (pools, members, heartbeats, health sweeps, admin views, and the ``Context`` every
operation runs in), ``joins`` (joining and rejoining) with ``limits`` (the join rate limit),
``beats`` (heartbeats written in batches) and ``health`` (the silence thresholds), ``penalties``
(hard and soft invalidation of a node), ``assignments`` (the secrets that make a node's tasks
unpredictable to it, committed in the ledger beforehand) and ``audit`` (the database checked
against its ledger before the orchestrator serves).

Knows nothing about HTTP or about the work itself: leases, submissions, verdicts and batches are
in ``swarmrl.pool.flow``, which calls in here, never the other way round.
"""
