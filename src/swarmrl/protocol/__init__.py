"""swarmrl.protocol: typed messages that cross a process boundary (see docs/architecture.md).

One module per conversation: ``pool`` (orchestrator API), ``proofs``, ``shardcast``, ``swarm``.
"""

from swarmrl.protocol.pool import (
    BatchReply,
    BatchRequest,
    Heartbeat,
    HeartbeatReply,
    Invite,
    LeaseReply,
    NodeMetadata,
    NodeView,
    PendingSubmission,
    PoolInfo,
    PoolSpec,
    Requirements,
    Sample,
    SamplingParams,
    Submission,
    SubmissionReceipt,
    TrainableSubmission,
    Verdict,
    VerdictReceipt,
    WorkUnit,
)

__all__ = [
    "BatchReply",
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
