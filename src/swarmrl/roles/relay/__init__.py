"""The relay role: a weight cache tier that follows upstream origins or relays and serves the
versions it has verified against the publisher's signature. Process wiring only; the work is in
:mod:`swarmrl.shardcast`."""
