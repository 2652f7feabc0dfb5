"""The config part of every verb's command line: ``[CONFIG] [--set section.key=value …]``.

Every role verb and the ``shardcast`` tool take the same two things: an optional TOML file
(default: the embedded config) and dotted overrides with the same keys as the TOML. Flags about
the process itself (host, port, key file, peer URLs, directories) stay flags of the verb.

Knows argparse and the config tree only; imports no torch and no HTTP code.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

from swarmrl.config.load import EMBEDDED_DEFAULT, load_config
from swarmrl.config.root import SwarmConfig


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The optional positional ``config`` and the repeatable ``--set`` (dest ``overrides``)."""
    parser.add_argument(
        "config", nargs="?", default=None, help="TOML config (default: the embedded one)"
    )
    add_override_args(parser)


def add_override_args(parser: argparse.ArgumentParser) -> None:
    """The repeatable ``--set section.key=value`` (dest ``overrides``), the same on every verb."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key, same dotted keys as the TOML (repeatable)",
    )


def config_from_args(args: argparse.Namespace) -> SwarmConfig:
    """Embedded default or ``args.config``, then each ``--set``; unknown keys fail in one line."""
    return load_config([args.config or EMBEDDED_DEFAULT], args.overrides)


# may carry credentials (a PostgreSQL password, object-store keys): shown as set or not only
_HIDDEN = {"pool": ("db_url", "store_url")}


def public_section(config: SwarmConfig, name: str) -> dict[str, Any]:
    """One section as JSON-ready values, with the keys that may hold credentials masked."""
    data = getattr(config, name).model_dump(mode="json")
    for key in _HIDDEN.get(name, ()):
        data[key] = "<set>" if data[key] else ""
    return data


def _changed(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that differ from ``defaults``, descending into sub-tables."""
    out = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            value = _changed(value, default)
            if value:
                out[key] = value
        elif value != default:
            out[key] = value
    return out


def config_line(config: SwarmConfig, sections: Iterable[str] | None = None) -> str:
    """The keys of the resolved config (or of some sections) that differ from the defaults, as
    one short line of JSON for a role's log; ``swarmrl config show CONFIG`` prints every key."""
    names = list(sections) if sections is not None else list(SwarmConfig.model_fields)
    defaults = SwarmConfig()
    data = {}
    for name in names:
        changed = _changed(public_section(config, name), public_section(defaults, name))
        if changed:
            data[name] = changed
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
