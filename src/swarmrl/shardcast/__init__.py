"""swarmrl.shardcast (see docs/architecture.md)."""
