"""swarmrl.trainer (see docs/architecture.md)."""
