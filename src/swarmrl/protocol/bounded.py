"""Bounded types for what an untrusted peer may put in a message: clean text and JSON values.

Peer text (:data:`PeerText`) is a string without NUL characters and without lone
UTF-16 surrogates. JSON's ``\\ud800`` escape decodes to a lone surrogate, which no UTF-8 encoder
accepts (so it could never be hashed, signed, stored or served), and PostgreSQL refuses NUL in
text columns; both are refused at the edge, as a schema error (HTTP 422), instead of failing
later inside a transaction.

A peer JSON value (inside :data:`PeerProof`) is an object whose nesting depth, item count, string
lengths and integers are bounded and whose numbers are finite, so that it can always be
serialised again (canonical JSON, a Parquet cell, a reply) with no recursion limit, NaN or
encoding error in the way. The limits are constants here because the wire format, not a
deployment, decides them:

- depth ≤ :data:`MAX_JSON_DEPTH` (an object or array inside another counts one level),
- at most :data:`MAX_JSON_ITEMS` values in all, strings of at most :data:`MAX_JSON_STRING` chars,
- integers in [−2^63, 2^63), floats finite, keys and strings peer text.

Knows nothing about what a proof means (``swarmrl.protocol.proofs``) or HTTP.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

MAX_JSON_DEPTH = 16
MAX_JSON_ITEMS = 200_000
MAX_JSON_STRING = 1 << 20

_UNCLEAN = re.compile("[\x00\ud800-\udfff]")


def check_text(value: str) -> str:
    """``value`` unchanged, or ValueError if it holds a NUL or a lone UTF-16 surrogate."""
    bad = _UNCLEAN.search(value)
    if bad is not None:
        what = "a NUL character" if bad.group() == "\x00" else "a lone UTF-16 surrogate"
        raise ValueError(f"text holds {what} at position {bad.start()}")
    return value


PeerText = Annotated[str, AfterValidator(check_text)]


def check_json(value: Any) -> Any:
    """``value`` unchanged if it is a bounded JSON value (module docstring), else ValueError.

    Walks iteratively, so a deep value costs no recursion before it is refused.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    items = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > MAX_JSON_ITEMS:
            raise ValueError(f"JSON value holds more than {MAX_JSON_ITEMS} items")
        if isinstance(node, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"JSON value nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(node, dict):
                for key, child in node.items():
                    if not isinstance(key, str):
                        raise ValueError("JSON object keys must be strings")
                    _check_string(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            _check_string(node)
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            if not -(2**63) <= node < 2**63:
                raise ValueError("JSON integers must lie in [-2^63, 2^63)")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError("JSON numbers must be finite (no NaN or Infinity)")
        else:
            raise ValueError(f"not a JSON value: {type(node).__name__}")
    return value


def _check_string(value: str) -> None:
    if len(value) > MAX_JSON_STRING:
        raise ValueError(f"JSON string longer than {MAX_JSON_STRING} characters")
    check_text(value)


_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")


def check_proof(value: Any) -> Any:
    """A sample's proof as a peer sends it: None, hex bytes, or a bounded JSON object."""
    if value is None:
        return None
    if isinstance(value, str):
        if _HEX.fullmatch(value) is None:
            raise ValueError("proof string must be hex bytes (an even number of hex digits)")
        return value
    if isinstance(value, dict):
        return check_json(value)
    raise ValueError("proof must be a JSON object, a hex string or null")


PeerProof = Annotated[dict[str, Any] | str | None, BeforeValidator(check_proof)]
"""A proof from a peer: None, hex bytes or a JSON object bounded as the module docstring says."""
