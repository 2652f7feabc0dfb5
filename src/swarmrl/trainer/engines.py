"""Engines that follow an in-memory policy: the colocated run's generator and the evaluator.

``policy_engine`` opens the engine ``inference.backend`` names over a copy of a policy held in
memory: the torch engine wraps a deep copy; the vLLM engine starts on the policy saved to a
scratch directory (removed when the engine closes). Either takes later versions through
``Engine.load_state_dict``.

Knows nothing about the training loop or rollouts.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.interface import Engine, require_backend
from swarmrl.model.io import save_policy


def policy_engine(
    config: SwarmConfig,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    dtype: str | None = None,
) -> Engine:
    """An engine generating with (a copy of) ``policy``'s current weights, in ``dtype`` (None:
    ``config.engine_dtype``, the swarm's workers' dtype)."""
    require_backend(config.inference.backend)
    dtype = dtype or config.engine_dtype
    if config.inference.backend == "torch":
        return TorchEngine(copy.deepcopy(policy).to(getattr(torch, dtype)), tokenizer, device)
    from swarmrl.inference.vllm_engine import VllmEngine

    scratch = Path(tempfile.mkdtemp(prefix="swarmrl-policy-"))
    save_policy(policy, tokenizer, scratch)
    return VllmEngine(
        scratch,
        config.inference.vllm,
        dtype=dtype,
        device=device,
        remove_on_close=True,
    )
