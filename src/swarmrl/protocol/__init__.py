"""swarmrl.protocol (see docs/architecture.md)."""
