"""Load and save a policy (model + tokenizer) as a standard HF directory.

``save_policy`` writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer files; ``load_policy`` reads them back with ``from_pretrained`` (a local directory or a
hub id). A local-looking path that does not exist is a ``MissingPathError`` with a one-line
message, not a hub lookup; so is a hub id that cannot be found or fetched.

Knows nothing about versions, signatures or sharding (see ``swarmrl.shardcast``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from swarmrl.config.model import looks_local, model_dir
from swarmrl.errors import DiskWriteError, MissingPathError

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_policy(
    path: str | Path, dtype: DType = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from an HF directory or hub id, in eval mode on ``device``."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    name = str(path)
    if looks_local(name):
        name = str(model_dir(name))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=_DTYPES[dtype])
    except OSError as err:  # hub id not cached and the hub unreachable, or files missing
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MissingPathError(f"cannot load model {name!r}: {first_line}") from err
    model.to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF checkpoint directory."""
    return AutoTokenizer.from_pretrained(str(path))


def save_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    state_dict: dict[str, Any] | None = None,
) -> Path:
    """Write model and tokenizer into ``out_dir`` (created if needed) and return its path;
    ``state_dict`` (a snapshot of ``model``'s weights) is written instead of the live weights.

    A write that fails (a full disk) removes what it wrote of a directory it created and is one
    :class:`DiskWriteError`, not a traceback from deep inside transformers."""
    out = Path(out_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(out)
    except OSError as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise DiskWriteError(f"cannot save the policy to {out}: {exc.strerror or exc}") from exc
    return out
