"""Rejections of untrusted requests, each with the HTTP status it maps to.

All are :class:`swarmrl.errors.PeerError`: the peer did something wrong, we refuse and record.
"""

from __future__ import annotations

from swarmrl.errors import PeerError


class Rejected(PeerError):
    """A request refused for a reason the caller can read; ``status`` is its HTTP code."""

    status = 400


class Unauthorized(Rejected):
    status = 403


class NotFound(Rejected):
    status = 404


class Conflict(Rejected):
    status = 409


class Expired(Rejected):
    status = 410


class Invalid(Rejected):
    status = 422
