"""swarmrl.pool: the orchestrator's compute pool service (DESIGN.md §7; docs/pool.md).

Its parts, each a layer that imports only from those below it (checked by ``lint-imports``)::

    server       runs the orchestrator: builds its context from paths and serves the app
    web          the HTTP surface: routes, hot routes, front processes, error bodies, waits
    flow         the flow of work: admission, leases, submissions, spot checks, verdicts, batches
    trust        who takes part: pools and members, joins, heartbeats, health, penalties, audit
    state        what it keeps: the database, the rollout store, nonces
    rejections   the refusals every part raises (and the client raises again)

``client`` (what nodes, validators and the trainer call), ``invites`` (made offline from an
owner's key) and ``cli`` (``swarmrl pool``) are the outside of the service and import nothing of
it but ``rejections``. Imports nothing heavy here, so ``swarmrl pool`` starts fast.
"""
