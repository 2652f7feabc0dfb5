"""swarmrl.shardcast: signed, sharded, delta-compressed weight versions over HTTP relays.

``Publisher`` writes versions into a store, ``build_app``/``serve_in_thread`` serve a store,
``Follower`` makes a relay of a store, ``WeightClient`` fetches versions. See docs/shardcast.md.
"""

from swarmrl.shardcast.client import WeightClient
from swarmrl.shardcast.publisher import Publisher
from swarmrl.shardcast.server import serve_origin

__all__ = ["Publisher", "WeightClient", "serve_origin"]
