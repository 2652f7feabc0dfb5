"""swarmrl: reinforcement learning for language models on a swarm of untrusted computers.

Subpackages, one per subsystem or role (see docs/architecture.md):
``config`` (the pydantic config tree), ``errors``, ``identity`` (ed25519 keys, signing),
``protocol`` (typed wire messages), ``model``, ``envs``, ``inference``, ``rl``, ``trainer``,
``toploc``, ``shardcast``, ``pool``, ``ledger``, ``worker``, ``validator``, ``launch``.
"""

__version__ = "0.1.0"
