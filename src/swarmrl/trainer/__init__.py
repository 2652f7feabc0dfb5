"""swarmrl.trainer: everything that changes the policy's weights.

``sft`` and ``warmstart`` (the cached supervised warm start), ``batch`` (rollouts → padded
tensors), ``step`` (one clipped policy-gradient step), ``learner`` (the policy, its optimizer
and version, evaluation, the control arm), ``loop`` (the one training loop of every mode),
``source`` (the rollout-source interface and trusted scoring), ``rollout`` (the in-process
engine source), ``colocated`` (the loop over that source), ``evaluate`` (held-out accuracy)
and ``cli`` (the ``sft``/``eval``/``filter`` verbs). The swarm's trainer process runs the same
loop over the pool (:mod:`swarmrl.roles.trainer`).
"""
