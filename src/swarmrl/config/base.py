"""The base class every config section derives from, and the marker of keys that hold paths.

Knows nothing about TOML or the command line (see ``swarmrl.config.load``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# What a key holding a path may hold instead, which decides when a relative value is a path:
#   "path"            always a path
#   "path or hub id"  a path when it looks like one (./x, x/y/z, x.jsonl) or exists; else a
#                     Hugging Face hub id ("openai/gsm8k"), left as written
#   "path or command" a path when it holds a slash; else a command looked up on PATH
#   "path or URL"     a path unless it holds "://"
PathKind = Literal["path", "path or hub id", "path or command", "path or URL"]


def path_key(kind: PathKind = "path") -> dict[str, Any]:
    """``json_schema_extra`` of a field that holds a path: a relative value in a config file is
    taken from the file's folder, one on the command line from the current directory
    (``swarmrl.config.load``)."""
    return {"path": kind}


class Section(BaseModel):
    """A config section: unknown keys fail loudly, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
