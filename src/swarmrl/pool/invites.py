"""Making invites offline from a pool owner's key (verified by ``swarmrl.pool.trust.joins``)."""

from __future__ import annotations

import secrets
import time

from pydantic import ValidationError

from swarmrl.errors import UserError
from swarmrl.identity.keys import KeyPair, canonical_json
from swarmrl.protocol.pool import Invite


def make_invite(
    owner: KeyPair,
    pool_id: str,
    expires_in_s: float = 86400.0,
    node_id: str | None = None,
    *,
    now_s: float | None = None,
) -> Invite:
    """A fresh single-use invite to ``pool_id``, valid ``expires_in_s`` seconds."""
    unsigned = {
        "pool_id": pool_id,
        "invite_id": secrets.token_hex(16),
        "expires_at": round((time.time() if now_s is None else now_s) + expires_in_s, 3),
        "node_id": node_id,
    }
    try:
        return Invite(**unsigned, signature=owner.sign(canonical_json(unsigned)))
    except ValidationError as exc:  # a pool or node id the user typed: say which, in one line
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise UserError(f"invite {field} {first.get('input')!r}: {first['msg']}") from exc
