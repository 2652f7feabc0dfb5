"""swarmrl.pool (see docs/architecture.md)."""
