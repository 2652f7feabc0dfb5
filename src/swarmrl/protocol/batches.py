"""Wire types of the trainer's conversation with the orchestrator: its progress (the policy
version it trains, how far ahead it holds its batches) and the batches of accepted submissions
it leases and acknowledges (``swarmrl.pool.flow.batches``). The submissions themselves are the
pool protocol's (``swarmrl.protocol.pool``).
"""

from __future__ import annotations

from pydantic import Field

from swarmrl.protocol.pool import Message, RecordId, Sample, wait_s_field


class VersionUpdate(Message):
    """The trainer's progress. ``steps`` and ``tasks_per_step`` let the orchestrator size what it
    leases before it has measured the trainer (``swarmrl.pool.flow.admission``); ``finished`` says the
    run's last step is trained, after which leases answer ``finished``. Example: ``{"version":
    3, "steps": 20, "tasks_per_step": 32, "finished": false}``.
    """

    version: int = Field(ge=0, lt=2**31, description="the trainer's current policy version")
    steps: int | None = Field(
        None,
        ge=0,
        lt=2**31,
        description="the policy version the run ends at: its RL steps, plus any versions a "
        "resumed trainer skipped; None = not told (kept)",
    )
    tasks_per_step: int | None = Field(
        None, gt=0, lt=2**31, description="groups (tasks) one step trains on; None = not told"
    )
    finished: bool = Field(False, description="True: the last step is trained; the run is over")


class TrainerProgress(Message):
    """How far ahead the trainer holds its batches: ``batched_through`` is the highest step
    (numbered as in :class:`BatchRequest`) whose whole batch it holds, and every earlier step's
    too. Work that only steps up to it could train (generated with a version ≤
    ``batched_through − async_level``) is not leased (``swarmrl.pool.flow.admission``). Example:
    ``{"batched_through": 7}``.
    """

    batched_through: int = Field(
        ge=0, lt=2**31, description="the highest step whose whole batch the trainer holds"
    )


class BatchRequest(Message):
    """Lease a batch of accepted submissions for trainer step n.

    Served submissions are leased to ``holder`` for the orchestrator's ``batch_lease_s`` and
    must be acknowledged (:class:`BatchAck`) once the step that trained them has committed;
    unacknowledged ones go back to the queue when their lease runs out. Each request renews
    the holder's other unacknowledged leases, so a live trainer keeps what it carries over.
    ``max_tasks`` bounds the answer in tasks as well: submissions are served in order until
    their tasks reach it (the last one may go past it; at least one is served), so a trainer
    takes what its step lacks and leaves the rest queued where admission control counts it.
    Example: ``{"step": 3, "limit": 64, "max_tasks": 40, "holder": "9f2c…"}``.
    """

    step: int = Field(
        ge=0, lt=2**31, description="trainer step n; versions ≥ n − async_level are served"
    )
    limit: int = Field(64, gt=0, le=4096, description="most submissions to return")
    max_tasks: int | None = Field(
        None, gt=0, le=2**20, description="serve until the tasks served reach this; None: no bound"
    )
    holder: RecordId = Field(
        "trainer", description="who holds the lease: random per trainer process"
    )
    wait_s: float = wait_s_field()


class BatchAck(Message):
    """Submissions a trainer has trained (or dropped for good) in a committed step.

    Example: ``{"submission_ids": ["0b9b…", "ce3e…"]}``.
    """

    submission_ids: list[RecordId] = Field(max_length=4096)


class BatchAckReceipt(Message):
    acknowledged: int = Field(description="leases turned into trained units by this ack")
    already: int = Field(description="ids that were acknowledged before (repeats are harmless)")


class TrainableSubmission(Message):
    submission_id: str
    node_id: str
    task_indices: list[int]
    samples: list[Sample]
    behaviour_logprobs: list[list[float]] | None = Field(
        description="validator replay, [n_samples][T_i]; None = not validated"
    )


class BatchReply(Message):
    step: int
    submissions: list[TrainableSubmission]
