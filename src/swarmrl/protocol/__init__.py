"""swarmrl.protocol: typed messages that cross a process boundary (see docs/architecture.md).

One module per conversation: ``pool`` (orchestrator API), ``verdicts`` (a validator's claims and
verdicts), ``batches`` (the trainer's progress and batches), ``proofs``, ``shardcast``, ``swarm``, ``episodes`` (multi-turn rollouts as token
segments);
``sampling`` holds the sampling parameters and finish reason all of them share.
"""

from swarmrl.protocol.batches import BatchReply, BatchRequest, TrainableSubmission
from swarmrl.protocol.pool import (
    Heartbeat,
    HeartbeatReply,
    Invite,
    LeaseReply,
    NodeMetadata,
    NodeView,
    PoolInfo,
    PoolSpec,
    Requirements,
    Sample,
    Submission,
    SubmissionReceipt,
    WorkUnit,
)
from swarmrl.protocol.sampling import FinishReason, SamplingParams
from swarmrl.protocol.verdicts import PendingSubmission, Verdict, VerdictReceipt

__all__ = [
    "BatchReply",
    "FinishReason",
    "BatchRequest",
    "Heartbeat",
    "HeartbeatReply",
    "Invite",
    "LeaseReply",
    "NodeMetadata",
    "NodeView",
    "PendingSubmission",
    "PoolInfo",
    "PoolSpec",
    "Requirements",
    "Sample",
    "SamplingParams",
    "Submission",
    "SubmissionReceipt",
    "TrainableSubmission",
    "Verdict",
    "VerdictReceipt",
    "WorkUnit",
]
