"""swarmrl.trainer: everything that changes the policy's weights.

``sft`` and ``warmstart`` (the cached supervised warm start), ``batch`` (rollouts → padded
tensors), ``step`` (one clipped policy-gradient step, shared by every mode), ``rollout`` and
``colocated`` (generate-then-train in one process), ``evaluate`` (held-out accuracy) and ``cli``
(the ``sft``/``eval``/``filter`` verbs). The swarm's trainer process is
:mod:`swarmrl.roles.trainer`.
"""
