"""swarmrl.envs (see docs/architecture.md)."""
