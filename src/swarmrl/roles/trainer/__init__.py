"""The trainer role: the trusted process that owns the optimizer, runs the weight origin and
publishes each policy version. Wiring only; the learning is :mod:`swarmrl.trainer`."""
