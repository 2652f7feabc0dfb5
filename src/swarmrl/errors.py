"""The one error hierarchy of swarmrl: every exception it raises on purpose is defined here.

::

    SwarmError                      base of everything swarmrl raises on purpose
    ├── UserError                   the person running swarmrl must fix something; the CLI prints
    │   │                           one line (no traceback) and exits with status 2
    │   ├── ConfigError             unknown key, bad value, unreadable TOML
    │   ├── MissingPathError        a model directory, dataset or key file that is not there
    │   ├── DatasetError            a dataset row that cannot be used (names file and row)
    │   ├── EngineUnavailable       the configured inference engine is not installed or cannot
    │   │                           load this model (names the install command or the reason)
    │   ├── SandboxError            the code sandbox cannot start here (names the cause)
    │   ├── LedgerMismatch          the pool database disagrees with its signed ledger (a cut
    │   │                           tail, edited rows): the orchestrator refuses to start
    │   ├── CheckpointMismatch      a trainer checkpoint written for another model or config
    │   ├── AdapterMismatch         a LoRA adapter that does not belong to the base beside it
    │   │                           (other base weights, shapes or target modules)
    │   └── ProtocolMismatch        the orchestrator speaks a newer pool protocol: upgrade
    ├── PeerError                   an untrusted peer sent something wrong: reject it, record it,
    │   │                           penalise the peer; never crash, never silently accept.
    │   │                           ``code`` is the machine-readable name the pool answers with
    │   ├── BadSignature            bad_signature: missing, malformed or forged signature
    │   ├── ReplayedRequest         replayed_request: reused nonce, timestamp outside the window
    │   ├── OversizedRequest        oversized_request: a request body over the size limit
    │   ├── BadProof                bad_proof: proof bundle null, truncated, oversized, inconsistent
    │   ├── CorruptData             corrupt_data: bytes whose digest does not match the signed one
    │   ├── ForgedEpisode           forged_episode: an episode's environment turns or turn
    │   │                           structure differ from the trusted recomputation
    │   └── Rejected                rejected: a request that breaks a rule of the pool. The pool
    │       │                       raises it where it decides; ``swarmrl.pool.client`` raises the
    │       │                       same type, read from the answer's code, at the requester
    │       ├── Unauthorized        unauthorized: the signer may not do this
    │       │   ├── NodeBanned      node_banned: the node is banned from the pool, for good
    │       │   └── NotMember       not_member: the node is dead or ejected; joining again helps
    │       ├── NotFound            not_found: no such pool, node, lease or submission
    │       ├── Conflict            conflict: already done, already exists, or out of order
    │       │   └── StaleWork       stale_work: samples of a policy too old to train; the lease
    │       │                       stays the node's: generate again on a newer one, submit again
    │       ├── Expired             expired: an invite or lease past its deadline
    │       ├── RateLimited         rate_limited: too many new identities joining; retry later
    │       └── Invalid             invalid: a value that breaks a pool rule
    │           ├── Malformed       malformed: a body that does not match the message schema
    │           └── BadRequest      invalid_request_error: a serving API request it cannot answer
    ├── ToolError                   a tool of a multi-turn environment refused the model's
    │                               arguments; the message is the environment's reply (it never
    │                               leaves the episode)
    ├── HarnessFailed               a verifiers harness episode ended without a usable trace (the
    │                               program crashed, hung past its timeout, or its trace differs
    │                               from what the engine sampled); the message says which task
    │   └── HarnessTimedOut         ... because it ran past its timeout (a slow machine as much as
    │                               the episode: the trusted side drops it without a ban)
    ├── Abandoned                   the client of a served request went away; its generation
    │                               stopped (or never started)
    ├── VersionGone                 a weight version every source has pruned: it will not come
    │                               back, so retrying is pointless (not an InfraError)
    └── InfraError                  our own infrastructure failed: retry, back off, report
        ├── PeerUnavailable         a server we need did not answer in time
        │   └── ObjectMissing       no weight source has this object (every one answered 404)
        ├── WaitTimeout             a bounded wait ran out; the message says what it waited for
        ├── DiskWriteError          writing to the local disk failed (full disk, I/O error)
        ├── FetchAborted            another part of the same download failed; this part stops
        ├── RoleExited              a role process ended while the swarm still needed it
        ├── RankAborted             another rank of a sharded trainer stopped; this one follows
        └── ServiceUnavailable      a local service (a test's PostgreSQL) cannot be had here

Rule of thumb: ``PeerError`` is about *who* (a peer misbehaved), ``InfraError`` about *what*
(a link or disk failed). Code that catches one never catches the other by accident, and code
branches on these types (or their ``code``), never on the words of a message. The HTTP status
of each code is in ``swarmrl.pool.rejections`` and docs/pool.md. A private signal (a class
with a leading underscore) may live in the one module that raises and catches it, as long as
only errors of this tree leave that module.
"""

from __future__ import annotations

from typing import ClassVar


class SwarmError(Exception):
    """Base class of every error swarmrl raises on purpose."""


class UserError(SwarmError):
    """Something the person running swarmrl must fix; shown as one line by the CLI."""


class ConfigError(UserError):
    """Unknown config key, bad value, or unreadable config file."""


class MissingPathError(UserError):
    """A file or directory the user named does not exist or cannot be read."""


class DatasetError(UserError):
    """A dataset row that cannot be used; the message names the file and row."""


class EngineUnavailable(UserError):
    """The configured inference backend is missing or cannot run this model."""


class SandboxError(UserError):
    """The sandbox that runs completions' code cannot start; the message names the cause."""


class LedgerMismatch(UserError):
    """The pool database and its ledger disagree (names the first disagreements)."""


class CheckpointMismatch(UserError):
    """A trainer checkpoint written for another model or config than the one being run."""


class AdapterMismatch(UserError):
    """A LoRA adapter trained on other base weights, or whose targets or shapes do not fit."""


class ProtocolMismatch(UserError):
    """The orchestrator speaks a newer pool protocol than this swarmrl: upgrade to join it."""


class PeerError(SwarmError):
    """An untrusted peer sent something wrong. Reject, record, penalise."""

    code: ClassVar[str] = "peer_error"


class BadSignature(PeerError):
    """A signature is missing, malformed, forged, or made by a key we do not accept."""

    code = "bad_signature"


class ReplayedRequest(PeerError):
    """A nonce was reused or a timestamp falls outside the accepted window."""

    code = "replayed_request"


class OversizedRequest(PeerError):
    """A request body larger than the server accepts."""

    code = "oversized_request"


class BadProof(PeerError):
    """A proof bundle is null, truncated, oversized, non-finite or inconsistent."""

    code = "bad_proof"


class CorruptData(PeerError):
    """Bytes whose digest does not match the signed one."""

    code = "corrupt_data"


class ForgedEpisode(PeerError):
    """An episode whose environment turns or turn structure differ from the trusted side's
    recomputation (a forged tool result, environment tokens claimed as sampled)."""

    code = "forged_episode"


class Rejected(PeerError):
    """A request refused by a rule of the pool; the message says which rule."""

    code = "rejected"


class Unauthorized(Rejected):
    """The signer may not do this (not admin, not a validator, not the leaseholder...)."""

    code = "unauthorized"


class NodeBanned(Unauthorized):
    """The node is banned from the pool; no request of it will be accepted again."""

    code = "node_banned"


class NotMember(Unauthorized):
    """The node was declared dead or was ejected; it may join again."""

    code = "not_member"


class NotFound(Rejected):
    """No such pool, node, lease or submission."""

    code = "not_found"


class Conflict(Rejected):
    """Already done, already exists, or older than what the pool holds."""

    code = "conflict"


class StaleWork(Conflict):
    """Samples generated on a policy version the trainer can no longer use (older than the
    current version − ``async_level``, or than the lease's ``min_version``). Nothing was stored
    and the lease stays the node's until its deadline: generating it again on a newer version
    and submitting that is the remedy."""

    code = "stale_work"


class Expired(Rejected):
    """An invite or a lease past its deadline."""

    code = "expired"


class RateLimited(Rejected):
    """Too many new nodes are joining the pool right now; the same request succeeds later."""

    code = "rate_limited"


class Invalid(Rejected):
    """A well-formed request whose values break a pool rule."""

    code = "invalid"


class Malformed(Invalid):
    """A request body that does not match the message schema."""

    code = "malformed"


class BadRequest(Invalid):
    """A request to the serving API (``swarmrl serve``) that asks for something it does not
    offer (HTTP 400); ``param`` names the field, as OpenAI-style errors do."""

    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ToolError(SwarmError):
    """A tool refused the model's arguments; the message is what the model is told."""


class HarnessFailed(SwarmError):
    """A harness episode (``swarmrl.envs.vf1``) produced no usable trace; one line says why."""


class HarnessTimedOut(HarnessFailed):
    """A harness episode ran past its timeout and was killed."""


class Abandoned(SwarmError):
    """The client that asked for a generation went away; it was stopped (or never started)."""


class VersionGone(SwarmError):
    """A policy version that every answering source has pruned; it will never be served again."""


class InfraError(SwarmError):
    """Our own infrastructure failed (network, disk, a dead process). Retry or report."""


class PeerUnavailable(InfraError):
    """A server we depend on did not answer in time."""


class ObjectMissing(PeerUnavailable):
    """No weight source has this object (every one answered 404)."""


class WaitTimeout(InfraError):
    """A bounded wait ran out. The message says what was being waited for."""


class DiskWriteError(InfraError):
    """Writing received or published bytes to the local disk failed (full disk, I/O error)."""


class FetchAborted(InfraError):
    """Another part of the same download failed; this part stops quietly."""


class RankAborted(InfraError):
    """Another rank of a sharded trainer stopped; the message says which and why."""


class RoleExited(InfraError):
    """A role process ended while the swarm still needed it; the message quotes its log tail."""


class ServiceUnavailable(InfraError):
    """A local service a command or test needs cannot be had here (no binaries, no start)."""


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM turned into one) or was
    raised while one unwound: a library whose clean-up fails when the interrupt lands inside it
    (torch's function-mode stack under ``from_pretrained``: "trying to pop from empty mode
    stack") replaces the interrupt with an error of its own, the interrupt its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
