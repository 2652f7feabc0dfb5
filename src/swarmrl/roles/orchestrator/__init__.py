"""The orchestrator role: the pool service process. Wiring only; the work is in
:mod:`swarmrl.pool`."""
