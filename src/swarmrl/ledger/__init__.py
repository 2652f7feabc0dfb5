"""swarmrl.ledger (see docs/architecture.md)."""
