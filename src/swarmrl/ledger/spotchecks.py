"""Spot-check arithmetic, and its re-verification from a ledger alone.

Which submissions a validator checks is decided by two numbers:

- the node's *check rate* ``p = max(floor, decay ** clean)``, with ``clean`` the number of its
  checks passed since its last failed check (since it joined, if none failed): 1 for a new node,
  falling geometrically with a clean record toward ``floor``, and back to 1 after a failed check
  (a hard rejection; a soft one drops a unit without blame and leaves ``clean`` as it was);
- the submission's *draw* ``u = HMAC-SHA256(secret, "spot-check/<pool>/<submission id>") / 2^256``
  in [0, 1), keyed with the secret of the assignment epoch open when the submission arrived
  (``swarmrl.pool.trust.assignments``: committed in the ledger when the epoch opens, revealed when it
  closes).

The submission is checked exactly when ``u < p``. The node cannot predict ``u`` (it never holds
the secret before the epoch closes, and the submission id is drawn by the orchestrator after the
request arrives), so it cannot learn or grind which of its submissions will be checked.

:class:`SpotCheckReplay` folds ledger entries in order and re-derives, for every submission
entry, the rate it must have been checked at and, once its epoch's secret is revealed, whether
it must have been checked; it also checks that every ``release`` entry (unchecked work made
trainable) follows passed checks of ``release_after_checks`` later submissions of the same node
and ``release_young_checks`` of the node in all, and that the ones it sends to a check instead
(``replay``) are exactly those whose release draw ``HMAC-SHA256(secret,
"release-check/<pool>/<submission id>") / 2^256`` is below ``release_replay_fraction`` (keyed
with the secret of the epoch the release names). With twins (``twin_fraction``, the pool
module ``swarmrl.pool.flow.twins``) it also re-derives which unchecked submissions were drawn
for a twin (``HMAC-SHA256(secret, "twin/<pool>/<submission id>")``; a drawn one the pool
leased to nobody, no other node being healthy, is recorded ``alone``), that a twin's submission
repeats one so drawn, from another node, that a twin entry joining the two as a match names
submissions whose ``digest`` is equal and releases nothing, that every twin's answer taken
at rate 0 was compared, and that a hard invalidation sends to a check (``recheck``) exactly the
matched answers, by nodes not banned, of twins of the banned node's submissions. Knows nothing about databases or HTTP; the rates
come from the pool's ``pool_created`` entry (``swarmrl.ledger.replay``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarmrl.ledger.replay import LedgerReplay, spec_value

DRAW_BITS = 256


def check_rate(clean: int, floor: float, decay: float) -> float:
    """Check rate of a node with ``clean`` passed checks since its last failure:
    ``max(floor, decay ** clean)`` (1.0 for a new node; ``0 ** 0`` is 1)."""
    return max(floor, decay**clean)


def draw(secret: str, pool_id: str, submission_id: str, purpose: str = "spot-check") -> float:
    """The submission's uniform draw in [0, 1): HMAC-SHA256 under the epoch secret. ``purpose``
    keeps the draw at submission (``spot-check``) and the one at release (``release-check``)
    independent."""
    message = f"{purpose}/{pool_id}/{submission_id}".encode()
    mac = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return int.from_bytes(mac, "big") / 2**DRAW_BITS


def is_checked(secret: str, pool_id: str, submission_id: str, rate: float) -> bool:
    return draw(secret, pool_id, submission_id) < rate


def is_replayed(secret: str, pool_id: str, submission_id: str, fraction: float) -> bool:
    """Whether an unchecked submission a passed check would release is checked instead."""
    return draw(secret, pool_id, submission_id, "release-check") < fraction


def is_twinned(secret: str, pool_id: str, submission_id: str, fraction: float) -> bool:
    """Whether an unchecked submission's unit is leased again to another node (a twin)."""
    return draw(secret, pool_id, submission_id, "twin") < fraction


@dataclass
class _Pool:
    floor: float
    decay: float
    has_validators: bool
    release_after: int = 1  # passed checks of later submissions that release unchecked work
    release_young: int = 0  # passed checks in all a node needs before anything is released
    replay_fraction: float = 0.0  # share of it checked instead at release
    twin_fraction: float = 0.0  # share of unchecked submissions leased again as twins
    clean: dict[str, int] = field(default_factory=dict)  # node → passed checks since a failure
    checked: dict[str, tuple[str, bool]] = field(default_factory=dict)  # sid → (node, checked)
    order: dict[str, int] = field(default_factory=dict)  # sid → seq of its submission entry
    passed: set[str] = field(default_factory=set)  # checked submissions whose check passed
    passed_seqs: dict[str, list[int]] = field(default_factory=dict)  # node → seqs of those
    twinned: set[str] = field(default_factory=set)  # unchecked submissions drawn for a twin
    twin_of: dict[str, str] = field(default_factory=dict)  # twin's submission → the original
    digests: dict[str, str] = field(default_factory=dict)  # submission → its samples' digest
    awaiting_match: set[str] = field(default_factory=set)  # twins' answers at rate 0
    matched: set[str] = field(default_factory=set)  # twins' answers equal to their unit's
    banned: set[str] = field(default_factory=set)  # nodes with a hard invalidation


@dataclass
class SpotCheckReplay(LedgerReplay[_Pool]):
    """Re-derives spot-check decisions from ledger entries fed in sequence order.

    ``feed`` returns "" or why the entry contradicts the rules (module docstring). Draws whose
    epoch secret is not revealed yet are listed in ``unrevealed`` and checked by :meth:`finish`
    against any reveal that came later.
    """

    subject: ClassVar[str] = "spot-check"
    secrets: dict[tuple[str | None, int], str] = field(default_factory=dict)
    open_epoch: dict[str | None, int] = field(default_factory=dict)  # newest committed epoch
    # (pool, epoch, submission, rate, checked, purpose) of draws awaiting their epoch's secret
    unrevealed: list[tuple[str | None, int, str, float, bool, str]] = field(default_factory=list)
    verified: int = 0  # submission draws recomputed and matching

    def _pool(self, spec: dict[str, Any]) -> _Pool:
        return _Pool(
            float(spec_value(spec, "validated_fraction")),
            float(spec_value(spec, "check_rate_decay")),
            bool(spec.get("validators")),
            int(spec_value(spec, "release_after_checks")),
            int(spec_value(spec, "release_young_checks")),
            float(spec_value(spec, "release_replay_fraction")),
            float(spec_value(spec, "twin_fraction")),
        )

    def _entry(self, entry: dict[str, Any], kind: str, body: dict[str, Any], pool_id: Any) -> str:
        if kind == "assignment_commit":
            self.open_epoch[pool_id] = int(body.get("epoch", -1))
            return ""
        if kind == "assignment_reveal":
            self.secrets[(pool_id, int(body.get("epoch", -1)))] = str(body.get("secret"))
            return ""
        pool = self.pools.get(pool_id)
        if pool is None:
            return ""
        if kind == "submission":
            return self._submission(pool, pool_id, entry)
        if kind == "verdict":
            return self._verdict(pool, entry)
        if kind == "release":
            if entry["body"].get("twin"):
                return self._twin(pool, entry)
            return self._release(pool, entry)
        if kind == "invalidation" and body.get("severity") == "hard":
            return self._recheck(pool, entry)
        return ""

    def _recheck(self, pool: _Pool, entry: dict[str, Any]) -> str:
        """A node banned: the matched answers of its submissions' twins, by nodes not banned,
        go to a check (``swarmrl.pool.trust.penalties``), and nothing else does."""
        node = str(entry["node_id"])
        pool.banned.add(node)
        if "recheck" not in entry["body"]:  # written before matched copies were rechecked
            return ""
        due = {
            sid
            for sid in pool.matched
            if pool.checked.get(pool.twin_of[sid], ("", True))[0] == node
            and pool.checked.get(sid, ("", True))[0] not in pool.banned
        }
        listed = {str(s) for s in entry["body"].get("recheck", [])}
        if listed != due:
            return (
                f"invalidation of node {node} sends {sorted(listed)} to a check; the matched "
                f"answers of its twins are {sorted(due)}"
            )
        for sid in listed:
            pool.checked[sid] = (pool.checked[sid][0], True)
            pool.matched.discard(sid)
        return ""

    def _submission(self, pool: _Pool, pool_id: str | None, entry: dict[str, Any]) -> str:
        body, node = entry["body"], str(entry["node_id"])
        sid, check = str(body.get("submission_id")), body.get("check")
        pool.order[sid] = int(entry["seq"])
        if check is None:  # written before spot checks existed: every one was judged or not
            return ""
        if body.get("digest") is not None:
            pool.digests[sid] = str(body["digest"])
        want = check_rate(pool.clean.get(node, 0), pool.floor, pool.decay)
        rate, checked = check.get("rate"), bool(check.get("checked"))
        twin_of = body.get("twin_of")
        # a twin's answer compared with its unit is judged by the match, drawn at rate 0 (an
        # answer on another version is drawn like any submission)
        by_match = twin_of is not None and bool(check.get("by_twin"))
        if check.get("by_twin") and (twin_of is None or checked):
            return f"submission {sid} is recorded as judged by a twin comparison it cannot have"
        if not pool.has_validators or by_match:
            want = 0.0
        if twin_of is not None:
            pool.twin_of[sid] = str(twin_of)
            if str(twin_of) not in pool.twinned:
                return f"submission {sid} claims to repeat {twin_of}, which was drawn for no twin"
            if by_match:
                pool.awaiting_match.add(sid)
        if rate != want:
            return (
                f"submission {sid} was checked at rate {rate!r}; the ledger's record gives {want!r}"
            )
        pool.checked[sid] = (node, checked)
        key = (pool_id, int(check.get("epoch", -1)))
        if key[1] != self.open_epoch.get(pool_id):
            return f"submission {sid} was drawn in epoch {key[1]}, not the open one"
        reason = self._draw_or_wait(pool_id, key[1], sid, want, checked, "spot-check")
        if reason or checked or by_match or not pool.twin_fraction:
            return reason
        twinned, alone = bool(check.get("twin")), bool(check.get("alone"))
        if twinned and alone:
            return f"submission {sid} is recorded both twinned and without a node to twin it"
        if twinned:
            pool.twinned.add(sid)
        # "alone": drawn for a twin that no other healthy node could answer, so none was leased
        drawn = twinned or alone
        return self._draw_or_wait(pool_id, key[1], sid, pool.twin_fraction, drawn, "twin")

    def _draw_or_wait(
        self, pool_id: str | None, epoch: int, sid: str, rate: float, checked: bool, purpose: str
    ) -> str:
        secret = self.secrets.get((pool_id, epoch))
        if secret is not None:
            return self._draw(pool_id, epoch, sid, rate, checked, secret, purpose)
        self.unrevealed.append((pool_id, epoch, sid, rate, checked, purpose))
        return ""

    def _draw(
        self,
        pool_id: str | None,
        epoch: int,
        sid: str,
        rate: float,
        checked: bool,
        secret: str,
        purpose: str = "spot-check",
    ) -> str:
        if (draw(secret, str(pool_id), sid, purpose) < rate) != checked:
            return (
                f"submission {sid}: recorded {purpose} = {checked}, but the draw under the "
                f"revealed secret of epoch {epoch} says {not checked}"
            )
        self.verified += 1
        return ""

    def _verdict(self, pool: _Pool, entry: dict[str, Any]) -> str:
        body, node = entry["body"], str(entry["node_id"])
        sid = str(body.get("submission_id"))
        if body.get("accept"):
            pool.clean[node] = pool.clean.get(node, 0) + 1
            pool.passed.add(sid)
            pool.passed_seqs.setdefault(node, []).append(pool.order.get(sid, -1))
        elif body.get("severity", "hard") == "hard":  # soft: dropped without blame
            pool.clean[node] = 0
        if pool.checked.get(sid, (node, True))[1] is False:
            return f"verdict on submission {sid}, which was not selected for a check"
        return ""

    def _release(self, pool: _Pool, entry: dict[str, Any]) -> str:
        body, node = entry["body"], str(entry["node_id"])
        by = str(body.get("by"))
        if by not in pool.passed or pool.checked.get(by, ("", False))[0] != node:
            return f"release by {by}, which is no passed check of node {node}"
        released = [str(s) for s in body.get("submission_ids", [])]
        replayed = [str(s) for s in body.get("replay", [])]
        later_passed = pool.passed_seqs.get(node, [])
        if (released or replayed) and len(later_passed) < pool.release_young:
            return (
                f"release by {by} after {len(later_passed)} passed checks of node {node}; the "
                f"pool releases none before {pool.release_young}"
            )
        for sid in released + replayed:
            owner, checked = pool.checked.get(sid, ("", True))
            order = pool.order.get(sid, 1 << 62)
            if owner != node or checked or order > pool.order[by]:
                return f"release of {sid}: not an earlier unchecked submission of node {node}"
            passes = sum(seq > order for seq in later_passed)
            if passes < pool.release_after:
                return (
                    f"release of {sid} after {passes} passed checks of later submissions; "
                    f"the pool releases after {pool.release_after}"
                )
        if replayed or pool.replay_fraction > 0:
            epoch = int(body.get("epoch", -1))
            for sid in released + replayed:
                reason = self._draw_or_wait(
                    entry["pool_id"], epoch, sid, pool.replay_fraction, sid in replayed,
                    "release-check",
                )  # fmt: skip
                if reason:
                    return reason
        for sid in replayed:  # checked from now on: a verdict on it is due
            pool.checked[sid] = (node, True)
        return ""

    def _twin(self, pool: _Pool, entry: dict[str, Any]) -> str:
        """A twin's output arrived: equal samples leave the twin as a duplicate (the original
        waits for the usual release); differing ones, or ones of another version, send what is
        unchecked of the two to validators (``swarmrl.pool.flow.twins``)."""
        body, node = entry["body"], str(entry["node_id"])
        by = str(body.get("by"))
        original = pool.twin_of.get(by)
        if original is None or pool.checked.get(original, ("", True))[0] != node:
            return f"twin release by {by}, which repeats no submission of node {node}"
        if pool.checked.get(by, (node, False))[0] == node:
            return f"twin release by {by}: a node answered its own twin"
        released = [str(s) for s in body.get("submission_ids", [])]
        replayed = [str(s) for s in body.get("replay", [])]
        if body.get("apart"):  # other versions: the original, if unchecked, goes to a check
            if released or not set(replayed) <= {original} or by in pool.awaiting_match:
                return f"twin release by {by} (apart) releases or checks other submissions"
        elif by not in pool.awaiting_match:
            return f"twin release by {by}, which was drawn for a spot check like any submission"
        elif body.get("matched"):
            if pool.digests.get(by) is None or pool.digests.get(by) != pool.digests.get(original):
                return f"twin release by {by}: its samples' digest differs from {original}'s"
            if replayed or released:  # a match releases nothing: the usual release does
                return f"twin match by {by} releases or checks submissions"
        elif released or not set(replayed) <= {original, by}:
            return f"twin mismatch of {by} releases work or checks other submissions"
        for sid in released + replayed:
            if pool.checked.get(sid, ("", True))[1]:
                return f"twin release by {by}: {sid} was not unchecked"
        for sid in replayed:
            pool.checked[sid] = (pool.checked[sid][0], True)
        pool.awaiting_match.discard(by)
        if body.get("matched"):
            pool.matched.add(by)
        return ""

    def finish(self) -> str:
        """Check the draws whose secret was revealed after their submission entry, and that
        every twin's answer taken at rate 0 was settled by a comparison (its entry follows the
        submission's in the same append)."""
        for pool in self.pools.values():
            if pool.awaiting_match:
                sid = sorted(pool.awaiting_match)[0]
                return f"submission {sid} was taken unchecked as a twin's answer, never compared"
        for pool_id, epoch, sid, rate, checked, purpose in self.unrevealed:
            secret = self.secrets.get((pool_id, epoch))
            if secret is not None:
                reason = self._draw(pool_id, epoch, sid, rate, checked, secret, purpose)
                if reason:
                    return reason
        self.unrevealed = [u for u in self.unrevealed if (u[0], u[1]) not in self.secrets]
        return ""
