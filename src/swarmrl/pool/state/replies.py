"""Reply bodies for routes that hand rows out (validator claims, trainer batches).

Such a route changes state (a claim, a batch lease) and must not commit unless its reply exists,
or a row would be handed out that nobody received. So the reply's JSON is built inside the
transaction, row by row: a row whose stored rollout cannot be read or serialised (a damaged
store file, a value no encoder accepts) is set aside as ``quarantined`` with a logged reason,
instead of failing the reply for every row behind it. Knows nothing about HTTP or pool rules.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic import BaseModel

from swarmrl.pool.state import db

log = logging.getLogger("swarmrl.pool")
R = TypeVar("R")


def serialise_rows(
    conn: sa.Connection,
    rows: Iterable[R],
    build: Callable[[R], BaseModel],
    submission_id: Callable[[R], str],
) -> tuple[list[R], list[bytes]]:
    """The rows that could be served and their JSON; the others are quarantined in ``conn``."""
    served: list[R] = []
    parts: list[bytes] = []
    for row in rows:
        sid = submission_id(row)
        try:
            part = build(row).model_dump_json().encode()
        except (OSError, ValueError, RecursionError) as exc:
            # OSError: store file missing or unreadable; ValueError: Arrow, pydantic, encoding
            log.error("submission %s cannot be served and is quarantined: %s", sid, exc)
            conn.execute(
                db.submissions.update()
                .where(db.submissions.c.submission_id == sid)
                .values(status="quarantined", claimed_by=None)
            )
            continue
        served.append(row)
        parts.append(part)
    return served, parts


def empty_listing(body: bytes) -> bool:
    """Whether ``body``, made by :func:`json_object`, has no items in its list (the list is
    written last, so an empty one ends the object)."""
    return body.endswith(b":[]}")


def json_object(fields: dict[str, Any], list_field: str, parts: list[bytes]) -> bytes:
    """``{**fields, list_field: [parts…]}`` as JSON bytes; ``parts`` are serialised items."""
    head = json.dumps(fields, separators=(",", ":"))[1:-1].encode()
    return b"{%s%s%s:[%s]}" % (
        head,
        b"," if head else b"",
        json.dumps(list_field).encode(),
        b",".join(parts),
    )
