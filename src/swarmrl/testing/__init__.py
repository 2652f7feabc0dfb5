"""Tools for testing and benchmarking a swarm, shipped so that anyone can attack their own pool:

- ``pool_nodes``: many simulated nodes signing real requests against a pool (load tests);
- ``cheats``: cheating workers' proof builders (wrong model, quantized weights, cheaper decoding);
- ``shardcast``: throw-away stores, keys and checkpoints for weight-distribution tests.

Nothing in the production roles imports this package.
"""
