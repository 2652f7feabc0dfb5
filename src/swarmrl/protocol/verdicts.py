"""Wire types of a validator's conversation with the pool (DESIGN.md §7): it claims pending
submissions (:class:`ClaimRequest` → :class:`ClaimReply` of :class:`PendingSubmission`), replays
them, and sends one :class:`Verdict` each, which carries the unit's evidence measurements when it
accepts (``swarmrl.toploc.evidence``); the pool answers with a :class:`VerdictReceipt`.

Signed at the HTTP layer like every request (``swarmrl.identity.requests``). What a verdict does
to the node's record is the pool's (``swarmrl.pool.flow.judging``); this module only says what
travels.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from swarmrl.protocol.pool import (
    EVIDENCE_CAP,
    EvidenceMeasure,
    Message,
    Reason,
    RecordId,
    Sample,
    Severity,
    ShortText,
    WorkUnit,
    wait_s_field,
)


class ClaimRequest(Message):
    limit: int = Field(8, gt=0, le=256, description="most submissions to hand out")
    wait_s: float = wait_s_field()
    engine: ShortText | None = Field(
        None,
        description="the engine the validator replays on (its inference.backend): the pool "
        "hands it the units of nodes that declared this engine first, and keeps the units of "
        "another engine's nodes for that engine's validators while one claims "
        "(swarmrl.pool.flow.judging); None = any unit, in the order of age",
    )


class PendingSubmission(Message):
    """A submission for a validator to replay, with the lease it answered.

    The ``request_*`` fields and ``body_digest`` let anyone re-check the node's signature over
    its submit request (``swarmrl.identity.requests.request_message`` with method POST and path
    ``/pools/{pool_id}/submissions``); the same values are in the ledger's submission entry.
    """

    submission_id: str
    node_id: str
    node_key: str = Field(description="public key that signed the submission")
    request_signature: str = Field(description="the node's signature over the submit request")
    body_digest: str = Field(description="sha256 of the submitted body")
    request_timestamp_ms: int = Field(description="X-Swarm-Timestamp of the submit request")
    request_nonce: str = Field(description="X-Swarm-Nonce of the submit request")
    engine: str | None = Field(
        None,
        description="the inference engine the node declared when it last joined "
        "(NodeMetadata.engine); the validator measures the unit's evidence against the honest "
        "means of this engine replayed on its own (ToplocConfig.evidence_pairing_references); "
        "None = not known, the loosest pairing's",
    )
    work: WorkUnit
    samples: list[Sample]


class ClaimReply(Message):
    submissions: list[PendingSubmission]


class Verdict(Message):
    """A validator's judgement of one submission.

    ``behaviour_logprobs`` is [n_samples][T_i], the validator's replayed per-token log-probs,
    required when accepting. Example: ``{"submission_id": "…", "accept": false, "severity":
    "hard", "reasons": ["proof chunk 2: 41/128 exponents match"], "measured_tokens": 0}``.
    """

    submission_id: RecordId
    accept: bool
    severity: Severity = Field("hard", description="for rejections: hard bans, soft drops one unit")
    reasons: list[Reason] = Field(default_factory=list, max_length=64)
    measured_tokens: int = Field(ge=0, lt=2**62, description="tokens the validator replayed")
    behaviour_logprobs: list[list[float]] | None = Field(None, description="[n_samples][T_i]")
    evidence: dict[EvidenceMeasure, Annotated[float, Field(ge=0, le=EVIDENCE_CAP)]] | None = Field(
        None,
        description="accepting only: the unit's measurements, each normalised by its "
        "threshold (swarmrl.toploc.evidence), added to the node's record by the pool",
    )


class VerdictReceipt(Message):
    submission_id: str
    status: Literal["accepted", "rejected", "disputed"] = Field(
        description="disputed = a rejection recorded as one vote; the quorum is not complete"
    )
    credited_tokens: int
    reasons: list[Reason] = Field(
        default_factory=list,
        max_length=64,
        description="why an accepting verdict was recorded as a rejection (the node's evidence "
        "passed its limit with this unit); empty otherwise",
    )
