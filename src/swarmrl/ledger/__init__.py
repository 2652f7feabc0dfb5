"""swarmrl.ledger: the hash-chained, orchestrator-signed contribution ledger (docs/pool.md).

``chain`` appends entries, ``export`` writes files, ``verify`` checks them offline,
``reputation`` scores a node's record.
"""
