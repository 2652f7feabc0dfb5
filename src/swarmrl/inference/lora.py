"""A LoRA policy version: base weights plus a low-rank adapter, merged before inference.

A version published with ``[model.lora]`` is the base checkpoint (``config.json``,
``model.safetensors``, tokenizer files: the same bytes in every version, so shardcast sends
them once and clients copy them from the version they hold) plus ``lora/``:

    lora/adapter_config.json       peft's LoraConfig (r, lora_alpha, target_modules, …)
    lora/adapter_model.safetensors peft's adapter tensors: ``<module>.lora_A.weight`` [r, in]
                                   and ``<module>.lora_B.weight`` [out, r]
    lora/base.json                 {"sha256": {file: digest}} of the base weight files the
                                   adapter was trained on

Engines load the base, then replace each targeted weight by

    W' = W + (alpha / r) · B @ A          (computed in float32, stored in the model dtype)

so a worker and a validator holding the same version run the same merged weights, whichever
engine they use. :func:`write_merged` writes the merged version as a plain checkpoint, for a
server that loads a directory and nothing else. Merging needs torch and safetensors only, not peft.

An adapter whose base digests differ from the base files beside it, whose tensors do not fit
the base, or whose files cannot be read is refused with :class:`AdapterMismatch` (a user
error: the version directory is not what it claims) or :class:`CorruptData` (unreadable).

Knows nothing about training, shardcast or which engine runs the merged weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from swarmrl.errors import AdapterMismatch, CorruptData

ADAPTER_DIR = "lora"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "base.json"
PEFT_PREFIX = "base_model.model."  # peft's key prefix before the wrapped model's own names
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass
class Adapter:
    """A LoRA adapter read from disk: per target weight, the two factors and the scale."""

    scaling: float  # alpha / r
    # "<module>.weight" → (A [r, in], B [out, r])
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_sha256: dict[str, str]  # base weight file → hex digest it was trained on


def has_adapter(path: str | Path) -> bool:
    """True when the checkpoint directory ``path`` carries a LoRA adapter."""
    return (Path(path) / ADAPTER_DIR / ADAPTER_CONFIG).is_file()


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            hasher.update(block)
    return hasher.hexdigest()


def base_weight_files(path: Path) -> list[str]:
    """The base's weight files in a checkpoint directory (top level, safetensors)."""
    return sorted(p.name for p in path.glob("*.safetensors"))


def read_adapter(path: str | Path) -> Adapter:
    """The adapter under ``path/lora``; :class:`CorruptData` when its files cannot be read."""
    folder = Path(path) / ADAPTER_DIR
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        base = json.loads((folder / BASE_FILE).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
        scaling = float(config["lora_alpha"]) / float(config["r"])
        digests = {str(k): str(v) for k, v in base["sha256"].items()}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise CorruptData(f"LoRA adapter in {folder} cannot be read: {exc}") from exc
    if config.get("use_rslora") or config.get("use_dora"):
        raise AdapterMismatch(f"LoRA adapter in {folder}: rsLoRA and DoRA are not supported")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(_A):
            continue
        module = key[: -len(_A)]
        b = tensors.get(module + _B)
        if b is None:
            raise CorruptData(f"LoRA adapter in {folder}: {module} has lora_A but no lora_B")
        name = module.removeprefix(PEFT_PREFIX) + ".weight"
        factors[name] = (a, b)
    if not factors or len(tensors) != 2 * len(factors):
        raise CorruptData(f"LoRA adapter in {folder}: no lora_A/lora_B pairs, or stray tensors")
    return Adapter(scaling, factors, digests)


def check_base(path: str | Path, adapter: Adapter) -> None:
    """Refuse an adapter trained on other base weights than the files in ``path``."""
    local = Path(path)
    held = {name: file_sha256(local / name) for name in base_weight_files(local)}
    if held != adapter.base_sha256:
        raise AdapterMismatch(
            f"LoRA adapter in {local / ADAPTER_DIR} was trained on another base: it names "
            f"{_short(adapter.base_sha256)}, the directory holds {_short(held)}"
        )


def _short(digests: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {digest[:12]}" for name, digest in sorted(digests.items())) or "none"


def merge_factors(weights: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """The merged weights ``W + scaling · B @ A`` of every targeted entry of ``weights``."""
    merged: dict[str, torch.Tensor] = {}
    for name, (a, b) in adapter.factors.items():
        base = weights.get(name)
        if base is None:
            raise AdapterMismatch(f"LoRA adapter targets {name}, which the base model lacks")
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(base.shape) or a.shape[0] != b.shape[1]:
            raise AdapterMismatch(
                f"LoRA adapter for {name} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"the base weight is {tuple(base.shape)}"
            )
        delta = adapter.scaling * (b.float() @ a.float())  # [out, in]
        merged[name] = (base.detach().float().cpu() + delta).to(base.dtype)
    return merged


def merged_weights(model: torch.nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """The targeted weights of ``model`` (holding the base of ``path``) merged with the adapter
    of ``path``, after checking the adapter belongs to that base."""
    adapter = read_adapter(path)
    check_base(path, adapter)
    return merge_factors(model.state_dict(), adapter)


def write_merged(path: str | Path, out: str | Path) -> Path:
    """Write ``path`` (base + adapter) as a plain checkpoint in ``out`` with the adapter merged.

    The base's weight files keep their names and layout (an index file stays valid); every other
    top-level file (config, tokenizer) is copied; ``lora/`` is left out. For engines that load a
    directory and nothing else (vLLM's own server). ``out`` must not exist yet; returns it."""
    from safetensors.torch import save_file

    local, target = Path(path), Path(out)
    adapter = read_adapter(local)
    check_base(local, adapter)
    target.mkdir(parents=True)
    left = dict(adapter.factors)
    for name in base_weight_files(local):
        try:
            tensors = load_file(str(local / name))
        except (OSError, SafetensorError) as exc:
            raise CorruptData(f"base weights {local / name} cannot be read: {exc}") from exc
        mine = {k: v for k, v in left.items() if k in tensors}
        merged = merge_factors(tensors, Adapter(adapter.scaling, mine, adapter.base_sha256))
        save_file({**tensors, **merged}, str(target / name), metadata={"format": "pt"})
        left = {k: v for k, v in left.items() if k not in mine}
    if left:
        raise AdapterMismatch(f"LoRA adapter targets {sorted(left)[0]}, which the base lacks")
    for item in local.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, target / item.name)
    return target


@torch.no_grad()
def apply_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Merge the adapter of ``path`` into ``model`` (loaded from ``path``'s base), in place."""
    merged = merged_weights(model, path)
    params = dict(model.named_parameters())
    for name, value in merged.items():
        params[name].copy_(value)


def merge_peft_state(
    state: Mapping[str, torch.Tensor], scaling: float, adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """A peft model's state dict as the plain model's, with every adapter merged in.

    ``state`` has peft's keys (``base_model.model.<m>.base_layer.weight``,
    ``<m>.lora_A.<adapter_name>.weight``, ``<m>.lora_B.<adapter_name>.weight``); the result has
    the wrapped model's own keys (``<m>.weight``)."""
    out: dict[str, torch.Tensor] = {}
    a_tail, b_tail = f".lora_A.{adapter_name}.weight", f".lora_B.{adapter_name}.weight"
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):
            module = key[: -len(".base_layer.weight")]
            a, b = state[module + a_tail], state[module + b_tail]
            value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[name] = value
    return out


def adapter_tensors(
    state: Mapping[str, torch.Tensor], adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a peft state dict, under peft's saved names (no adapter name)."""
    tail = f".{adapter_name}.weight"
    return {
        key[: -len(tail)] + ".weight": value.detach().cpu().contiguous()
        for key, value in state.items()
        if ".lora_" in key and key.endswith(tail)
    }
