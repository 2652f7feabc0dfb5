"""swarmrl.model (see docs/architecture.md)."""
