"""swarmrl.inference (see docs/architecture.md)."""
