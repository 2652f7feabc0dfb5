"""How the pool answers an error, and how a client reads the answer back into the same type.

An error answer is ``{"error": {"code": "<code>", "message": "<what was wrong>"}}`` with the
HTTP status below; ``code`` is the error's :attr:`~swarmrl.errors.PeerError.code` (the tree is
drawn in ``swarmrl.errors``, every code is listed in docs/pool.md). The pool raises the types
where it decides; :func:`refusal` turns an answer back into the same type at the requester, so
callers branch on types, never on message words.

Knows nothing about routes, the database or transport.
"""

from __future__ import annotations

from typing import Any

from swarmrl.errors import (
    BadProof,
    BadSignature,
    Conflict,
    CorruptData,
    Expired,
    Invalid,
    Malformed,
    NodeBanned,
    NotFound,
    NotMember,
    OversizedRequest,
    PeerError,
    RateLimited,
    Rejected,
    ReplayedRequest,
    StaleWork,
    Unauthorized,
)

# HTTP status of each error type the pool answers with; subclasses not listed take their
# nearest listed base's status.
STATUS: dict[type[PeerError], int] = {
    PeerError: 400,
    BadProof: 400,
    CorruptData: 400,
    Rejected: 400,
    BadSignature: 401,
    ReplayedRequest: 401,
    Unauthorized: 403,
    NodeBanned: 403,
    NotMember: 403,
    NotFound: 404,
    Conflict: 409,
    StaleWork: 409,
    Expired: 410,
    OversizedRequest: 413,
    Invalid: 422,
    RateLimited: 429,
    Malformed: 422,
}

# every code the pool answers with, and the type a client raises for it
BY_CODE: dict[str, type[PeerError]] = {cls.code: cls for cls in STATUS}


def status_of(exc: PeerError) -> int:
    """The HTTP status the pool answers ``exc`` with."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400  # pragma: no cover - PeerError itself is in STATUS


def answer(exc: PeerError) -> dict[str, Any]:
    """The JSON body of the error answer to ``exc``."""
    return error_body(exc.code, str(exc))


def error_body(code: str, message: str) -> dict[str, Any]:
    """``{"error": {"code": code, "message": message}}``."""
    return {"error": {"code": code, "message": message}}


def refusal(code: str, message: str) -> PeerError:
    """The typed error for an answer with ``code``; an unknown code gives a plain
    :class:`~swarmrl.errors.Rejected` (a newer pool may know codes this client does not)."""
    return BY_CODE.get(code, Rejected)(message)


__all__ = [
    "BY_CODE",
    "STATUS",
    "Conflict",
    "Expired",
    "Invalid",
    "Malformed",
    "NodeBanned",
    "NotFound",
    "NotMember",
    "Rejected",
    "StaleWork",
    "Unauthorized",
    "answer",
    "error_body",
    "refusal",
    "status_of",
]
