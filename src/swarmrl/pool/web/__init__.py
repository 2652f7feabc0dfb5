"""The pool's HTTP surface: how requests reach the pool rules and how answers leave.

``app`` (the FastAPI routes and request authentication), ``hotroutes`` (the heartbeat, lease and
submission answered from the server's parser with the same checks), ``front`` and ``bridge``
(front processes that hold the nodes' connections and hand requests to the orchestrator over a
Unix socket), ``answers`` (the error body and the request-body limit), ``waits`` (listings held
until there is work to hand out) and ``metrics`` (Prometheus text and request latencies).

Knows nothing about what an operation decides: each route calls one function of
``swarmrl.pool.flow`` or ``swarmrl.pool.trust`` and writes back what it returns or raises.
"""
