"""Wire types of the compute pool protocol (DESIGN.md §7): pools, invites, nodes, heartbeats,
work units, submissions, admin views. A validator's claims and verdicts are in
``swarmrl.protocol.verdicts``, the trainer's progress and batches in ``swarmrl.protocol.batches``.

Every request that changes state is signed at the HTTP layer (``swarmrl.identity.requests``);
these messages carry no signatures of their own except :class:`Invite`, which travels offline
from the pool owner to a node. The proof bundle of a sample is opaque here (its format lives in
``swarmrl.protocol.proofs``); this module only bounds its size.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from swarmrl.protocol.bounded import PeerProof, PeerText
from swarmrl.protocol.episodes import Episode
from swarmrl.protocol.sampling import FinishReason, SamplingParams

# The pool protocol's version, raised whenever a wire type changes so that a peer of the version
# before would refuse a message (a new field: every Message refuses the fields it does not
# know). The orchestrator names it in /health; a client that cannot read an answer asks for it
# and, where the orchestrator's is newer, stops with one line saying to upgrade
# (swarmrl.pool.client).
# 2: claims name the validator's engine, pool specs name each validator's engine and the
# evidence's scale and limits, long-polls carry manifests, heartbeats' replies run_finished
PROTOCOL_VERSION = 2
POOL_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
HEX64 = r"^[0-9a-f]{64}$"
NODE_ID = r"^[0-9a-f]{32}$"
ShortText = Annotated[PeerText, StringConstraints(max_length=64)]
LabelKey = Annotated[PeerText, StringConstraints(min_length=1, max_length=64)]
LabelValue = Annotated[PeerText, StringConstraints(max_length=256)]
LogLine = Annotated[PeerText, StringConstraints(max_length=4096)]
Reason = Annotated[PeerText, StringConstraints(max_length=2000)]
RecordId = Annotated[PeerText, StringConstraints(min_length=1, max_length=64)]  # lease, submission
NodeState = Literal["healthy", "unhealthy", "dead", "ejected", "banned"]
Severity = Literal["hard", "soft"]
# what a validator measures on each accepted unit, each normalised by the threshold it is judged
# against (1 = at the threshold) and capped at EVIDENCE_CAP (swarmrl.toploc.evidence)
EvidenceMeasure = Literal["logprobs", "mantissa", "exponents"]
EVIDENCE_CAP = 2.0


class Message(BaseModel):
    """Base of every wire message: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Requirements(Message):
    """What a node must offer to join a pool. Example: ``{"engines": ["torch"], "min_memory_gb": 8,
    "accelerators": ["cpu", "cuda"]}``."""

    engines: list[ShortText] = Field(
        default_factory=list, max_length=16, description="accepted engines; empty = any"
    )
    min_memory_gb: float = Field(0.0, ge=0, description="minimum device memory, GiB")
    accelerators: list[ShortText] = Field(
        default_factory=list, max_length=16, description="accepted accelerators; empty = any"
    )


class PoolSpec(Message):
    """A pool (compute domain) as created by the orchestrator admin.

    Example: ``{"pool_id": "arith", "owner_key": "ab…", "task_count": 1000, "samples_per_task": 8,
    "open": false, "validators": ["cd…"]}``.
    """

    pool_id: str = Field(pattern=POOL_ID_PATTERN, description="stable name of the pool")
    owner_key: str = Field(pattern=HEX64, description="ed25519 public key of the pool owner")
    open: bool = Field(False, description="True: any node may join without an invite")
    requirements: Requirements = Field(default_factory=Requirements)
    validators: list[Annotated[str, Field(pattern=HEX64)]] = Field(
        default_factory=list, max_length=64, description="public keys allowed to post verdicts"
    )
    task_count: int = Field(gt=0, le=2**40, description="tasks are indices in [0, task_count)")
    samples_per_task: int = Field(1, gt=0, le=1024, description="completions per task (G)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    seed: int = Field(0, ge=0, lt=2**63, description="pool seed of the per-node task draw")
    async_level: int = Field(2, ge=0, le=1000, description="accept versions ≥ current − this")
    lease_version_lag: int = Field(
        0,
        ge=0,
        le=1000,
        description="a fresh lease may be generated on a policy this many versions older than "
        "admission would ask for (never older than current − async_level; "
        "swarmrl.pool.flow.admission.lowest_useful_version)",
    )
    validated_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="floor of a node's spot-check rate: the least share of its submissions "
        "that validators check (swarmrl.pool.flow.spotcheck)",
    )
    check_rate_decay: float = Field(
        0.9,
        ge=0,
        le=1,
        description="a node's check rate is max(validated_fraction, this ** checks passed since "
        "its last failed one): 1 for a new node, back to 1 after a failure",
    )
    release_after_checks: int = Field(
        1,
        ge=1,
        le=1000,
        description="an unchecked submission trains once this many checks of its node's later "
        "submissions passed (swarmrl.pool.flow.spotcheck); 1 = the next passed one",
    )
    release_young_checks: int = Field(
        0,
        ge=0,
        le=100_000,
        description="a node with fewer passed checks than this has none of its unchecked "
        "submissions released (swarmrl.pool.flow.spotcheck); 0 = no such wait",
    )
    release_replay_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of the unchecked submissions a passed check would release that are "
        "checked instead, drawn under the epoch secret (swarmrl.pool.flow.spotcheck)",
    )
    twin_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of the unchecked submissions whose unit (tasks and seed) is leased "
        "again to another node, drawn under the epoch secret; equal outputs release it, "
        "differing ones send both to validators (swarmrl.pool.flow.twins); 0 = none",
    )
    quorum: int = Field(
        1,
        ge=1,
        le=64,
        description="validators that judge a disputed (rejected) submission; it is rejected "
        "when more than half of them reject; 1 = the first verdict is final",
    )
    min_tasks_per_lease: int = Field(1, gt=0, le=4096, description="smallest work unit, tasks")
    max_tasks_per_lease: int = Field(16, gt=0, le=4096, description="largest work unit, tasks")
    lease_target_s: float = Field(30.0, gt=0, le=86400, description="work a lease should hold, s")
    lease_timeout_s: float = Field(120.0, gt=0, le=86400, description="lease deadline, s")
    max_leases_in_flight: int = Field(2, gt=0, le=64, description="open leases per node")
    credit_lock_s: float = Field(
        3600.0, ge=0, le=1e9, description="credits stay locked this long, s"
    )
    evidence_drift: float = Field(
        0.5,
        ge=0,
        le=EVIDENCE_CAP,
        description="k of the per-node CUSUM over accepted units' measurements "
        "(swarmrl.ledger.evidence): the share of a threshold a unit may sit at without adding "
        "to its node's evidence",
    )
    evidence_limit: float = Field(
        5.0,
        ge=0,
        le=1e6,
        description="h of the per-node CUSUM: the unit that takes a node's evidence past it is "
        "rejected (hard); 0 = keep the records and reject nobody for them",
    )
    evidence_measure_limits: dict[EvidenceMeasure, Annotated[float, Field(ge=0, le=1e6)]] = Field(
        default_factory=dict,
        description='h of one measure in place of evidence_limit (e.g. {"mantissa": 1}): '
        "measures whose honest spread differs get limits of their own",
    )
    evidence_scale: float = Field(
        0.0,
        ge=0,
        le=1e3,
        description="the unit validators measure evidence in (toploc.evidence_scale): 0 = "
        "shares of the thresholds, s > 0 = s honest means; the records add up what every "
        "validator sends, so a validator set otherwise refuses to judge for the pool",
    )
    validator_engines: dict[Annotated[str, Field(pattern=HEX64)], ShortText] = Field(
        default_factory=dict,
        max_length=64,
        description="the engine each validator replays on (its inference.backend), by key: "
        "such a validator's claims that name another engine are refused, and where any is "
        "given, every engine of requirements.engines needs one (a node declaring an engine no "
        "validator runs is measured against the loose cross-engine means only); empty = not "
        "said (each validator's claims name its engine)",
    )

    @model_validator(mode="after")
    def _validators_cover_the_engines(self) -> PoolSpec:
        strangers = sorted(k[:16] for k in self.validator_engines if k not in self.validators)
        if strangers:
            raise ValueError(f"validator_engines names keys that are not validators: {strangers}")
        uncovered = [
            e for e in self.requirements.engines if e not in set(self.validator_engines.values())
        ]
        if self.validator_engines and uncovered:
            raise ValueError(
                f"requirements.engines accepts {', '.join(uncovered)} but no validator of "
                "validator_engines replays on it: a node declaring it would be measured against "
                "the loose cross-engine means only; add a validator on each engine the pool "
                "accepts, or accept fewer engines"
            )
        return self


class PoolInfo(Message):
    """Public view of a pool."""

    spec: PoolSpec
    current_version: int = Field(description="policy version the trainer last announced")
    created_at: float = Field(description="Unix seconds")
    run_finished: bool = Field(False, description="the trainer finished the run's last step")


class Invite(Message):
    """A single-use, expiring ticket to join a closed pool, signed offline by the pool owner.

    ``signature`` covers ``canonical_json`` of every other field. Example:
    ``{"pool_id": "arith", "invite_id": "9f…", "expires_at": 1767225600.0, "node_id": null,
    "signature": "…"}``.
    """

    pool_id: str = Field(pattern=POOL_ID_PATTERN)
    invite_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="random; used once")
    expires_at: float = Field(ge=0, le=1e11, description="Unix seconds after which it is refused")
    node_id: str | None = Field(
        None, pattern=NODE_ID, description="only this node may use it; None = any node"
    )
    signature: str = Field(pattern=r"^[0-9a-f]{128}$", description="owner's ed25519 signature")

    def signed_part(self) -> dict[str, Any]:
        return self.model_dump(exclude={"signature"})


class NodeMetadata(Message):
    """What a node says about itself when joining (signed with the join request)."""

    engine: ShortText = Field(description="inference engine, e.g. 'torch', 'vllm'")
    memory_gb: float = Field(ge=0, le=1e6, description="device memory, GiB")
    accelerator: ShortText = Field(description="'cpu', 'cuda', 'mps', …")
    software_version: ShortText = Field("", description="swarmrl version of the node")
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        max_length=16,
        description="free-form; at most 16, keys ≤ 64 and values ≤ 256 characters",
    )


class JoinRequest(Message):
    metadata: NodeMetadata
    invite: Invite | None = Field(None, description="required unless the pool is open")


class RejoinRequest(Message):
    """A node ejected for silence (or declared dead) coming back with the key it joined with.

    Spends no invite; a banned node stays out, and a node never admitted must join. Example:
    ``{"metadata": {"engine": "torch", "memory_gb": 16, "accelerator": "cpu"}}``.
    """

    metadata: NodeMetadata = Field(description="the node now; checked against the requirements")


class NodeView(Message):
    """A node as the orchestrator sees it (admin and join/heartbeat replies)."""

    node_id: str
    public_key: str
    state: NodeState
    metadata: NodeMetadata
    joined_at: float = Field(description="Unix seconds")
    last_beat_at: float | None = Field(description="Unix seconds; None = never beat")
    model_version: int | None = Field(description="version the node reports loaded")
    reported_tokens_per_s: float | None = Field(description="throughput the node claims")
    measured_tokens_per_s: float | None = Field(description="our estimate; None = none yet")
    leases_in_flight: int
    reputation: float = Field(description="in [0, 1]; see swarmrl.ledger.reputation")


class Heartbeat(Message):
    status: Literal["ok", "degraded", "error"] = Field(description="the node's own view")
    model_version: int | None = Field(
        None, ge=0, lt=2**31, description="loaded policy; None = none yet"
    )
    tokens_per_s: float | None = Field(None, ge=0, le=1e9, description="decode throughput")
    log_tail: list[LogLine] = Field(
        default_factory=list,
        max_length=200,
        description="latest log lines, oldest first; each ≤ 4096 characters (stored cut shorter)",
    )


class HeartbeatReply(Message):
    state: NodeState
    current_version: int
    next_beat_s: float = Field(description="beat again within this many seconds")
    run_finished: bool = Field(
        False, description="the trainer finished the run: nothing more is trained, so stop"
    )


class WorkUnit(Message):
    """Tasks leased to one node.

    ``task_indices`` equal ``draw_tasks(pool seed, secret, origin_node_id, origin_counter, n,
    task_count)`` (``swarmrl.pool.flow.scheduling``) with the secret of ``assignment_epoch``, which
    the ledger reveals once that epoch closes, so anyone can recompute them afterwards. Example: ``{"lease_id": "…",
    "task_indices": [17, 902], "samples_per_task": 8, "seed": 77…, "min_version": 3, …}``.
    """

    lease_id: str
    pool_id: str
    node_id: str = Field(description="node holding the lease")
    task_indices: list[int] = Field(description="[n_tasks] indices into the pool's task set")
    samples_per_task: int = Field(description="completions per task (G)")
    sampling: SamplingParams
    seed: int = Field(description="sampling seed of this unit (63-bit)")
    min_version: int = Field(description="generate with a policy version at least this")
    deadline: float = Field(description="Unix seconds; later submissions are refused")
    origin_node_id: str = Field(description="node whose draw produced the tasks")
    origin_counter: int = Field(description="lease counter of that draw")
    assignment_epoch: int = Field(
        0, description="epoch whose secret drew the tasks (swarmrl.pool.trust.assignments)"
    )


LeaseOutcome = Literal["work", "wait", "finished"]


class LeaseReply(Message):
    """The answer to a lease request, told apart by ``outcome``:

    - ``work``: ``work`` holds the unit to generate;
    - ``wait``: nothing to do now (the node is not healthy, holds its lease cap, or the trainer
      already has, leased or queued all the rollouts it can train while they are fresh: see
      ``swarmrl.pool.flow.admission``); ask again after ``retry_after_s``;
    - ``finished``: the run is over (the trainer finished its last step); stop.

    Example: ``{"outcome": "wait", "work": null, "retry_after_s": 0.5, "reason": "admission:
    supply 96 ≥ demand 96 tasks"}``.
    """

    outcome: LeaseOutcome = Field("work", description="work, wait or finished (see above)")
    work: WorkUnit | None = Field(description="the unit when outcome is work; else None")
    retry_after_s: float = Field(description="seconds to wait before asking again (outcome wait)")
    reason: str = Field("", description="why there is no work, for a human")

    @model_validator(mode="after")
    def _work_iff_outcome_work(self) -> LeaseReply:
        if (self.work is not None) != (self.outcome == "work"):
            raise ValueError("work must be set exactly when outcome is 'work'")
        return self


def reason_kind(reason: str) -> str:
    """The rule a wait's ``reason`` names: the reason with its figures left out, so each
    admission rule is one kind and one rule's changing counts share it (``"# leases in flight
    (cap #)"``): what a worker logs once a minute per, and the orchestrator counts by."""
    return re.sub(r"\d+(?:\.\d+)?", "#", reason)


MAX_TURN_PROOFS = 256


class Sample(Message):
    """One completion, or one multi-turn episode. Shapes: ``prompt_tokens`` [P],
    ``output_tokens`` [T], ``logprobs`` [T].

    An episode (``episode`` set, see ``swarmrl.protocol.episodes``) keeps the same fields with
    these meanings: ``prompt_tokens`` is the task's prompt (the first segment's context),
    ``output_tokens`` and ``logprobs`` are the model turns' tokens and log-probs concatenated in
    order (what was sampled; environment tokens are in ``episode`` only), ``finish_reason`` is
    the last model turn's, ``proof`` is None and ``turn_proofs`` holds one proof bundle per model
    call, each over that call's whole prompt (earlier turns and environment turns included) and
    its sampled tokens. The episode's seed is the one the lease assigns the sample; its
    ``reward`` is left None (rewards are the trusted side's).
    """

    task_index: int = Field(ge=0, lt=2**40)
    prompt_tokens: list[int] = Field(max_length=1_000_000)
    output_tokens: list[int] = Field(max_length=1_000_000)
    logprobs: list[float] = Field(max_length=1_000_000, description="worker's, nats per token")
    finish_reason: FinishReason
    policy_version: int = Field(ge=0, lt=2**31, description="version that generated the tokens")
    proof: PeerProof = Field(
        None,
        description="proof bundle (swarmrl.protocol.proofs.ProofBundle) as a bounded JSON "
        "object, or as its JSON text's UTF-8 bytes in hex (proofs.proof_to_wire); None = no proof",
    )
    episode: Episode | None = Field(
        None, description="the turns of a multi-turn episode (class docstring); None: one turn"
    )
    turn_proofs: list[PeerProof] | None = Field(
        None,
        max_length=MAX_TURN_PROOFS,
        description="an episode's proof bundles, one per model call in order (as ``proof``)",
    )


class Submission(Message):
    lease_id: RecordId = Field(description="the lease this answers")
    samples: list[Sample] = Field(max_length=100_000, description="[n_tasks × G] completions")


class SubmissionReceipt(Message):
    submission_id: str
    status: Literal["pending"] = Field(
        description="not yet trainable: it awaits a spot check or a later passed check of the "
        "node, and which of the two is not told (so a node cannot learn which are checked)"
    )
    tokens: int = Field(description="output tokens counted in the submission")


MAX_WAIT_S = 10.0  # the longest an empty answer is held (``wait_s``)


def wait_s_field() -> Any:
    """The ``wait_s`` field of a request whose answer may be held (a claim, a batch)."""
    return Field(
        0.0,
        ge=0.0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="hold an answer that would be empty up to this many seconds, until there "
        "is something to hand out (0: answer at once)",
    )


class InvalidateRequest(Message):
    severity: Severity
    reason: Annotated[PeerText, StringConstraints(max_length=1000)]
    submission_id: RecordId | None = Field(None, description="soft: the unit to drop")


class NodeLogs(Message):
    node_id: str
    lines: list[str]


class PoolMetrics(Message):
    pool_id: str
    current_version: int
    nodes_by_state: dict[str, int]
    leases_active: int
    submissions_by_status: dict[str, int]
    credited_tokens: int = Field(description="validator-measured tokens credited, not dropped")
    locked_tokens: int = Field(description="credited tokens still inside the lock window")
    validators_by_engine: dict[str, int] = Field(
        default_factory=dict,
        description="validators that claimed within the claim timeout, by the engine they "
        "named (ClaimRequest.engine)",
    )
    nodes_by_engine: dict[str, int] = Field(
        default_factory=dict,
        description="live members (healthy, unhealthy) by the engine they declared at join "
        "(the 16 most common engines)",
    )
    engines_without_validator: list[str] = Field(
        default_factory=list,
        description="engines of live members that no validator named within the claim timeout "
        "while another engine's did: their units wait cross_engine_after_s, then another "
        "engine's validators judge them against the loose cross-engine means",
    )


class ErrorDetail(Message):
    """One refusal. Example: ``{"code": "node_banned", "message": "node 3f… is banned from this
    pool"}``."""

    code: str = Field(
        max_length=64, description="machine-readable reason (``swarmrl.errors``, docs/pool.md)"
    )
    message: str = Field(max_length=100_000, description="what was wrong, for a human")


class ErrorReply(Message):
    """The body of every 4xx answer of the pool. Example: ``{"error": {"code": "not_found",
    "message": "unknown pool 'x'"}}``."""

    error: ErrorDetail
