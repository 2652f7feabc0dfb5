"""swarmrl.worker (see docs/architecture.md)."""
