"""Config layering: defaults → TOML file(s) → dotted command-line overrides.

``load_config(["a.toml"], ["rl.group_size=8"])`` returns a validated :class:`SwarmConfig`.
Override values are parsed as TOML literals (``8``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``) and
fall back to a plain string. Every failure is a :class:`ConfigError` whose one-line message names
the dotted key and what is allowed. Imports no torch, so light tools can load configs.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from swarmrl.config.root import SwarmConfig
from swarmrl.errors import ConfigError, MissingPathError

EMBEDDED_DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "arith.toml"


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base`` (tables merge, other values replace)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(item: str) -> dict[str, Any]:
    """``"rl.group_size=8"`` → ``{"rl": {"group_size": 8}}``."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, _, raw = item.partition("=")
    parts = [p for p in dotted.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    tree: dict[str, Any] = {parts[-1]: _parse_value(raw.strip())}
    for part in reversed(parts[:-1]):
        tree = {part: tree}
    return tree


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown config key {key!r}"
    allowed = first.get("ctx", {}).get("expected")
    detail = f" (allowed: {allowed})" if allowed else ""
    return f"bad value for {key!r}: {first['msg']}{detail}; got {first.get('input')!r}"


def build_config(data: Mapping[str, Any]) -> SwarmConfig:
    try:
        return SwarmConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc


def load_config(files: Iterable[str | Path] = (), overrides: Iterable[str] = ()) -> SwarmConfig:
    """Defaults, then each TOML file in order, then each ``key=value`` override."""
    data: dict[str, Any] = {}
    for file in files:
        data = _merge(data, read_toml(file))
    for item in overrides:
        data = _merge(data, parse_override(item))
    return build_config(data)


def save_config(config: SwarmConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``config.json`` in ``run_dir``."""
    path = Path(run_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    return path
