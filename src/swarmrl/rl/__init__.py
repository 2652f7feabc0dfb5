"""swarmrl.rl (see docs/architecture.md)."""
