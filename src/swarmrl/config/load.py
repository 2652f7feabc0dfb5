"""Config layering: defaults → TOML file(s) → dotted command-line overrides.

``load_config(["a.toml"], ["rl.group_size=8"])`` returns a validated :class:`SwarmConfig`.
Override values are parsed as TOML literals (``8``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``) and
fall back to a plain string. Every failure is a :class:`ConfigError` whose one-line message names
the dotted key and what is allowed. Imports no torch, so light tools can load configs.

Keys that hold paths (declared with ``path_key`` in ``swarmrl.config.base``) are made absolute
as they are read: a relative path in a config file is taken from the file's folder, so
``swarmrl run ../swarmrl/configs/math.toml`` finds the file's data wherever it is started; a
relative path in a ``--set`` (or a default: ``run.run_dir``) from the current directory. The
resolved config therefore holds absolute paths and means the same when written elsewhere
(``RUN_DIR/config.toml``) and read again.

Some defaults follow the dtype the policy generates in (``SwarmConfig.engine_dtype``): below
float32 the toploc keys no file or override sets take the values a pool in that dtype needs
(``swarmrl.config.toploc.lower_dtype_defaults``), and the resolved config holds them too.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from swarmrl.config.base import PathKind
from swarmrl.config.root import SwarmConfig
from swarmrl.config.toploc import lower_dtype_defaults
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


def path_keys(
    model: type[BaseModel] = SwarmConfig, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], PathKind]:
    """Every key of the tree declared as a path (``path_key``), dotted parts → its kind."""
    keys: dict[tuple[str, ...], PathKind] = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        kind = extra.get("path")
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.update(path_keys(field.annotation, (*prefix, name)))
        elif kind is not None:
            keys[(*prefix, name)] = kind
    return keys


# file types a dataset may be, so ``data.jsonl`` is a path even where it does not exist yet
DATA_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".arrow"}


def _is_path(value: str, kind: PathKind, base: Path) -> bool:
    if kind == "path or command":
        return "/" in value
    if kind == "path or URL":
        return "://" not in value
    if kind == "path or hub id":  # a hub id is "name" or "owner/name"
        return (
            value.startswith(".")
            or value.count("/") > 1
            or Path(value).suffix in DATA_SUFFIXES
            or (base / value).exists()
        )
    return True


def anchor_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """``data`` (one layer's tables) with each relative path made absolute against ``base``."""
    for key, kind in path_keys().items():
        table: Any = data
        for part in key[:-1]:
            table = table.get(part) if isinstance(table, dict) else None
        value = table.get(key[-1]) if isinstance(table, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        if _is_path(value, kind, base):
            table[key[-1]] = os.path.normpath(base / value)
    return data


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
    if first["type"] == "value_error" and isinstance(first.get("input"), dict):
        where = f"in {key!r}" if key else "across sections"  # a section's own check, or the root's
        return f"bad values {where}: {first['ctx']['error']}"
    allowed = first.get("ctx", {}).get("expected")
    detail = f" (allowed: {allowed})" if allowed else ""
    return f"bad value for {key!r}: {first['msg']}{detail}; got {first.get('input')!r}"


def build_config(data: Mapping[str, Any]) -> SwarmConfig:
    try:
        return SwarmConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc


def load_config(files: Iterable[str | Path] = (), overrides: Iterable[str] = ()) -> SwarmConfig:
    """Defaults, then each TOML file in order, then each ``key=value`` override.

    Relative paths are taken from each file's folder, and from the current directory for
    overrides and defaults (see the module docstring)."""
    data: dict[str, Any] = {}
    for file in files:
        folder = Path(os.path.abspath(file)).parent
        data = _merge(data, anchor_paths(read_toml(file), folder))
    for item in overrides:
        data = _merge(data, anchor_paths(parse_override(item), Path.cwd()))
    defaults = anchor_paths(SwarmConfig().model_dump(mode="json"), Path.cwd())  # run.run_dir
    config = build_config(_merge(defaults, data))
    given = data.get("toploc")
    lower = lower_dtype_defaults(
        config.toploc, config.engine_dtype, given if isinstance(given, dict) else ()
    )
    if not lower:
        return config
    return build_config(_merge(_merge(defaults, {"toploc": lower}), data))


def save_config(config: SwarmConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``config.json`` in ``run_dir``."""
    path = Path(run_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    return path
