"""swarmrl.launch (see docs/architecture.md)."""
