"""swarmrl.ledger: the hash-chained, orchestrator-signed contribution ledger (docs/pool.md).

``chain`` appends entries, ``export`` writes files, ``verify`` checks them offline (and
``cli`` is ``swarmrl ledger``), ``reputation`` scores a node's record, ``counts`` names a run's
submission counts. ``replay`` is the base of the decisions ``verify`` re-derives from the
entries: ``spotchecks`` (which unchecked work a passed check released) and ``evidence`` (each
node's running record of measured deviations, and when it flags the node).
"""
