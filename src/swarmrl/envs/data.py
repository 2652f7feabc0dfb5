"""Dataset rows the way people hold them.

A source is one of:

- a ``.jsonl``/``.json``, ``.parquet`` or ``.csv`` file, read with what the core installs (the
  standard library's ``json``, ``pyarrow``);
- a local directory: one written by ``Dataset.save_to_disk`` (it holds ``dataset_info.json`` or
  ``state.json``), or a folder of data files ``datasets`` can read;
- otherwise a Hugging Face hub id (``openai/gsm8k``), which needs the machine to be online.

Only the last two go through Hugging Face ``datasets``, an optional dependency
(``pip install 'swarmrl[tasks]'``) imported only then; without it the error names the install
command. Every row is read once, when the environment is built, so a bad row is found at
start-up: a missing file is a :class:`MissingPathError`, an unusable row or column a
:class:`DatasetError` naming the source and the row (1-based).

Also the reference-answer formats of common math sets: GSM8K's ``#### 42``, a final
``\\boxed{...}``, or the plain text. Knows nothing about prompts, rewards or models.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from swarmrl.errors import ConfigError, DatasetError, MissingPathError

AnswerFormat = Literal["auto", "plain", "gsm8k", "boxed"]
DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")
INSTALL_HINT = "pip install 'swarmrl[tasks]'"


def require(module: str, purpose: str) -> Any:
    """Import an optional dependency, or a one-line :class:`ConfigError` naming the install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{purpose} needs the '{module}' package: {INSTALL_HINT}") from exc


def _looks_local(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or Path(source).suffix in DATA_FILES
        or source.count("/") > 1
    )


def _json_rows(path: Path) -> list[Any]:
    """The rows of a JSON lines file, or of a ``.json`` file holding one array of objects (or
    JSON lines, as ``datasets`` also accepts). Errors name the row (1-based)."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines under a .json name
        if isinstance(whole, list):
            return whole
        if whole is not None:
            raise DatasetError(f"{path}: expected an array of objects or JSON lines")
    rows = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} row {i}: not valid JSON ({exc.msg})") from exc
    return rows


def _read_file(path: Path) -> list[dict[str, Any]]:
    """Rows of one local data file, without ``datasets``."""
    if path.suffix in (".jsonl", ".json"):
        rows = _json_rows(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        import pyarrow.csv

        rows = pyarrow.csv.read_csv(path).to_pylist()
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {i}: expected an object, got {type(row).__name__}")
    # one set of columns for every row, a key a row lacks read as None (as ``datasets`` does)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in columns} for row in rows]


def _read_with_datasets(text: str, path: Path, split: str, config_name: str | None) -> Any:
    """A saved or data-file directory, or a hub id, through Hugging Face ``datasets``."""
    datasets = require("datasets", "reading a dataset directory or hub id")
    datasets.disable_progress_bars()
    if not path.is_dir():
        return datasets.load_dataset(text, config_name, split=split)
    if (path / "dataset_info.json").exists() or (path / "state.json").exists():
        data = datasets.load_from_disk(str(path))
    else:
        data = datasets.load_dataset(str(path), config_name)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DatasetError(f"{path}: no split {split!r} (has {', '.join(data)})")
        data = data[split]
    return data


def load_records(
    source: str | Path, split: str = "train", config_name: str | None = None
) -> list[dict[str, Any]]:
    """All rows of ``source`` (see the module docstring) as plain dicts, in order."""
    text = str(source)
    path = Path(text).expanduser()
    try:
        if path.is_file():
            if path.suffix not in DATA_FILES:
                raise DatasetError(f"{path}: unknown file type (use {', '.join(DATA_FILES)})")
            return _read_file(path)
        if not path.is_dir() and _looks_local(text):
            raise MissingPathError(f"dataset file not found: {path}")
        data = _read_with_datasets(text, path, split, config_name)
    except (DatasetError, MissingPathError, ConfigError):
        raise
    except ConnectionError as exc:
        raise DatasetError(f"{text}: not a local path and the hub is unreachable ({exc})") from exc
    except Exception as exc:  # datasets/pyarrow raise many types for unreadable data
        cause = str(exc.__cause__ or exc).splitlines()[0] if str(exc.__cause__ or exc) else ""
        raise DatasetError(f"{text}: cannot read dataset ({type(exc).__name__}: {cause})") from exc
    return [dict(row) for row in data]


def column_text(
    source: str | Path,
    records: Sequence[dict[str, Any]],
    index: int,
    column: str,
    key: str,
    numbers: bool = True,
) -> str:
    """Row ``index``'s ``column`` as non-empty text, else an error naming the row.

    ``numbers`` allows a number in place of text; ``key`` is the config key that names the
    column, so the message says what to change.
    """
    where = f"{source} row {index + 1}"
    row = records[index]
    if column not in row:
        columns = ", ".join(sorted(row)) or "none"
        raise DatasetError(f"{where}: no column '{column}' (has {columns}; set {key})")
    value = row[column]
    allowed = (str, int, float) if numbers else (str,)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "a string or number" if numbers else "a string"
        raise DatasetError(f"{where}: '{column}' must be {kind}, got {value!r}")
    if not str(value).strip():
        raise DatasetError(f"{where}: '{column}' is empty")
    return str(value)


def last_boxed(text: str) -> str | None:
    """The contents of the last balanced ``\\boxed{...}`` in ``text``, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####`` with thousands separators removed, or None."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def reference_answer(text: str, fmt: AnswerFormat) -> str | None:
    """The reference answer inside a dataset's answer text; None when ``fmt`` finds none."""
    if fmt == "gsm8k":
        return gsm8k_answer(text)
    if fmt == "boxed":
        return last_boxed(text)
    if fmt == "plain":
        return text.strip() or None
    found = gsm8k_answer(text)
    if found is None:
        found = last_boxed(text)
    return found if found is not None else (text.strip() or None)
