"""swarmrl.toploc (see docs/architecture.md)."""
