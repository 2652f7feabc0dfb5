"""swarmrl.validator (see docs/architecture.md)."""
