"""Tools for testing and benchmarking a swarm, shipped so that anyone can attack their own pool:

- ``pool_nodes``: many simulated nodes signing real requests against a pool (load tests);
- ``cheats``: cheating workers' proof builders (wrong model, quantized weights, cheaper decoding);
- ``shardcast``: throw-away stores, keys and checkpoints for weight-distribution tests.
- ``hosts``: several hosts on one machine (network namespaces, tbf-capped links, CPU quotas);
- ``linkproxy``: a TCP proxy adding delay, jitter, resets and a byte rate to a link;
- ``netprobe``: the small TCP probes (sink, sender, echo) run inside those hosts;
- ``deploy``: docs/deploy.md's worked example run on those hosts, each role by the page's command;
- ``tls``: a throw-away certificate authority and server certificates for HTTPS tests;
- ``runs``: short real ``swarmrl run``s for testing the tools that read run directories;
- ``vf1``: a verifiers 0.4 taskset with its harness, and a tiny policy for it (``swarmrl.envs.vf1``).

Nothing in the production roles imports this package.
"""
