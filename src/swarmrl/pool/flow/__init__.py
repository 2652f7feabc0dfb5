"""The flow of work, from lease to trainer batch: the stations a task passes through.

``admission`` (how many tasks may still be leased without wasting work) over ``progress`` (the
counts it needs), ``scheduling`` (the pure maths of task draws, seeds and lease sizes), ``work``
(leases and submissions), ``spotcheck`` (which submissions validators check, and when unchecked
work may train), ``twins`` (unchecked units generated again by another node and compared),
``judging`` (validators' claims and verdicts) and ``batches`` (the trainer's
side: policy versions, batch leases, acknowledgements).

Knows nothing about HTTP (``swarmrl.pool.web`` calls in here). Who may take part, and what
happens to a node a verdict condemns, is asked of ``swarmrl.pool.trust`` below.
"""
