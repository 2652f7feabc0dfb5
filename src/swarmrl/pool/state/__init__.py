"""What the pool keeps: its database, its rollout store and the nonces it has seen.

``db`` (tables and engine creation), ``store`` (every submission's signed body, in a local
directory or any fsspec URL) over ``segments`` (append-only segment files), ``nonces`` (signed
requests' nonces, so that none is accepted twice, across restarts and server processes) and
``replies`` (stored rows read back into reply bodies inside the transaction that hands them out).

Knows nothing about pool rules or HTTP: what a row means, and who may write it, is decided above.
"""
