"""Config of the toploc subsystem: proof shape, acceptance thresholds, limits on peer input.

The hidden-state thresholds default to the reference TOPLOC values, which were set for GPU
bf16 inference and are far too loose for a model replayed bit for bit (an int8-quantized
worker passes them). ``swarmrl run`` therefore calibrates the starting policy in its dtype at
run start and records the result in the run directory (``calibrate_at_start``); elsewhere run
``swarmrl toploc calibrate`` and point ``thresholds_path`` at the JSON it writes (its values
override the ones here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from swarmrl.config.base import Section, path_key

THRESHOLDS_FILE = "toploc-thresholds.json"  # run-start calibration, in the run directory


class ToplocConfig(Section):
    """Settings of `swarmrl.toploc` (proof building on workers, verification on validators)."""

    chunk_size: int = Field(32, gt=0, description="decoded tokens per proof chunk")
    topk: int = Field(128, gt=0, le=4096, description="hidden-state entries committed per chunk")
    min_exponent_matches: int = Field(
        90, ge=0, description="of topk compared entries, how many bf16 exponents must match"
    )
    max_mantissa_mean: float = Field(
        10.0, ge=0, description="largest accepted mean |mantissa difference| (bf16 ulps)"
    )
    max_mantissa_median: float = Field(
        8.0, ge=0, description="largest accepted median |mantissa difference| (bf16 ulps)"
    )
    sampling_tolerance: float = Field(
        1e-3,
        ge=0,
        description="near-tie slack of the Gumbel-max replay, in units of logit/T + noise",
    )
    sampling_outlier_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of a sample's tokens (at least one) whose Gumbel-max score may trail "
        "the replay's best by more than sampling_tolerance, each by at most "
        "sampling_outlier_factor x sampling_tolerance: an honest near-tie flipped by the fp32 "
        "decode/prefill tail needs that tail and a near-tie at one token, so one per sample",
    )
    sampling_outlier_factor: float = Field(
        10.0,
        ge=1,
        description="a token trailing the replay's best score by more than this multiple of "
        "sampling_tolerance rejects the sample",
    )
    top_p_tolerance: float = Field(
        1e-4, ge=0, description="slack on the top-p boundary, in probability mass"
    )
    logprob_tolerance: float = Field(
        1e-2,
        ge=0,
        description="largest accepted |reported - replayed| log-prob (nats) of every token but "
        "a sample's isolated misses (logprob_outlier_share)",
    )
    logprob_outlier_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="share of a sample's tokens (at least one) whose log-prob may miss "
        "logprob_tolerance, each by at most logprob_outlier_factor x logprob_tolerance: honest "
        "fp32 decode and prefill differ by a few 1e-4 nats at isolated ill-conditioned inputs, "
        "a cheat with other weights or dtype moves nearly every token",
    )
    logprob_outlier_factor: float = Field(
        10.0,
        ge=1,
        description="an isolated log-prob miss beyond this multiple of logprob_tolerance "
        "rejects the sample",
    )
    eos_min_prob: float = Field(
        1e-6,
        ge=0,
        le=1,
        description="a final stop token needs at least this replay probability (an honest "
        "sampler picks a token of probability q with chance q, so the floor costs about "
        "floor x tokens false rejections per sample)",
    )
    reward_tolerance: float = Field(
        1e-6, ge=0, description="largest accepted |reported - recomputed| reward"
    )
    evidence_drift: float = Field(
        0.5,
        ge=0,
        le=2,
        description="k of the per-node CUSUM the pool keeps (swarmrl.ledger.evidence; the pool "
        "spec's evidence_drift): what an accepted unit's mean measurement may sit at without "
        "adding to the node's evidence, in shares of a threshold (calibrated thresholds are "
        "twice the worst honest value, so honest units average below 0.5) or, with "
        "evidence_scale s, in units of s honest means",
    )
    evidence_limit: float = Field(
        5.0,
        ge=0,
        le=1e6,
        description="h of the per-node CUSUM (the pool spec's evidence_limit): the unit that "
        "takes a node's evidence past it is rejected (about h / (mean - k) units consistently "
        "off); 0 = keep no verdict on it; below float32 the default is 3 (2 without a "
        "calibration)",
    )
    evidence_measure_limits: dict[Literal["logprobs", "mantissa", "exponents"], float] = Field(
        default_factory=dict,
        description="h of one measure in place of evidence_limit (the pool spec's "
        "evidence_measure_limits), e.g. {mantissa = 1}: the honest spread of the measures "
        'differs (docs/toploc.md, "int8 below float32"); below float32 the default is '
        "{mantissa = 1, exponents = 0} where a calibration records the honest means",
    )

    @field_validator("evidence_measure_limits")
    @classmethod
    def _limits(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if not (math.isfinite(v) and 0 <= v <= 1e6)}
        if bad:
            raise ValueError(f"limits must be finite, from 0 to 1e6, not {bad}")
        return value

    evidence_scale: float = Field(
        0.0,
        ge=0,
        le=1e3,
        description="0: an accepted unit's evidence is measured in shares of the thresholds "
        "it is judged against; s > 0: in units of s times the honest mean of each measure "
        "that the calibration recorded (evidence_reference), which hardly moves with the "
        'number of calibration samples while the thresholds do (docs/toploc.md, "Evidence '
        'in reference units"); the drift then sits at evidence_drift x s honest means; below '
        "float32 the default is 2.5 where a calibration records the means",
    )
    evidence_reference: dict[str, float] | None = Field(
        None,
        description="honest mean per evidence measure (logprobs: nats per token, mantissa: "
        "ulps per chunk, exponents: share of a chunk's exponents that differ), as the "
        "calibration records it; thresholds_path's file sets it",
    )

    evidence_pairing_references: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="the honest means of each pairing 'worker->validator' (e.g. "
        "'torch->vllm'), as a calibration across engines records them; a validator judges a "
        "unit by the means of the pairing of the engine its worker declared and its own, and "
        "by evidence_reference where the pairing is not here; thresholds_path's file sets it",
    )

    @field_validator("evidence_reference")
    @classmethod
    def _finite_means(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = {k: v for k, v in (value or {}).items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"honest means must be finite and >= 0, not {bad}")
        return value

    @field_validator("evidence_pairing_references")
    @classmethod
    def _pairings(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for name, means in value.items():
            worker, arrow, validator = name.partition("->")
            if not (arrow and worker and validator):
                raise ValueError(f"a pairing is named 'worker->validator', not {name!r}")
            cls._finite_means(means)
        return value

    max_prompt_tokens: int = Field(4096, gt=0, description="longest accepted prompt, tokens")
    max_bundle_bytes: int = Field(
        8 * 2**20, gt=0, description="largest accepted serialised proof bundle, bytes"
    )
    replay_batch_tokens: int = Field(
        4096, gt=0, description="padded positions per batched validator prefill"
    )
    thresholds_path: str | None = Field(
        None,
        description="JSON from `swarmrl toploc calibrate`; None = use the values above",
        json_schema_extra=path_key(),
    )
    calibrate_at_start: bool = Field(
        True,
        description="with thresholds_path unset, `swarmrl run` calibrates the starting policy "
        "(model and dtype) before version 0 is published and records the thresholds as "
        "RUN_DIR/toploc-thresholds.json, which its validators then use",
    )
    engines: list[Literal["torch", "vllm"]] = Field(
        default_factory=list,
        max_length=2,
        description="engines the pool accepts from its workers (the pool spec's "
        "requirements.engines; a node declaring another is refused at join) and the run-start "
        "calibration measures in every pairing, worker and validator each way; [] = "
        "inference.backend alone: honest work on an engine the calibration never measured may "
        'be judged off (docs/toploc.md, "The engines a pool accepts")',
    )

    @field_validator("engines")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"name each engine once, not {value}")
        return value

    calibration_samples: int = Field(
        64,
        ge=1,
        description="honest samples generated for the run-start calibration, on each engine "
        "of toploc.engines; below float32 the default is 2048 (its honest tail is longer)",
    )


# what a pool generating in a dtype below float32 needs, measured by bench/evidence.py and
# bench/evidence_rules.py on tiny models, on torch alone and across torch and vLLM
# (docs/toploc.md, "int8 below float32"): thresholds from enough samples to hold the honest
# tail, the evidence in units of 2.5 honest means of the loosest pairing the calibration
# measured, and the mantissa, whose honest spread is narrow, at a limit of its own. The
# exponent share is recorded and not judged (limit 0): its honest mean sat within 0.03-0.04 of
# the drift on four of eight runs with torch alone, where no fixed limit holds for long, and
# within 20 units it was never the measure that stopped a cheat first
LOWER_DTYPE_SETTINGS: dict[str, Any] = {
    "calibration_samples": 2048,
    "evidence_scale": 2.5,
    "evidence_limit": 3.0,
    "evidence_measure_limits": {"mantissa": 1.0, "exponents": 0.0},
}
# the same without a calibration to record the honest means: evidence in shares of thresholds
UNCALIBRATED_LOWER_DTYPE_SETTINGS: dict[str, Any] = {
    "calibration_samples": 2048,
    "evidence_limit": 2.0,
}


def settings_literal(value: Any) -> str:
    """``value`` as a ``--set`` item writes it: 2.5, {mantissa=1}, ["torch","vllm"]."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={settings_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(f'"{v}"' for v in value) + "]"
    return f"{value:g}"


def engines_advice(engines: Sequence[str], out: str) -> str:
    """The line ``swarmrl toploc calibrate`` prints: the settings under which validators judge
    with the file ``out`` in a pool that accepts exactly the engines it measured."""
    items = f"toploc.engines={settings_literal(list(engines))} toploc.thresholds_path={out}"
    return (
        f"the file measured engines {', '.join(engines)}: for a pool that accepts these, every "
        f"role sets {items} (a validator refuses a file that misses an engine the pool accepts; "
        'docs/toploc.md, "The engines a pool accepts")'
    )


def lower_dtype_defaults(toploc: ToplocConfig, dtype: str, given: Iterable[str]) -> dict[str, Any]:
    """The toploc defaults a config generating in ``dtype`` takes in place of float32's, for
    each key not in ``given`` (the keys a config file or an override set); {} in float32.
    :data:`LOWER_DTYPE_SETTINGS` where a calibration records the honest means the evidence is
    measured in (``thresholds_path`` or ``calibrate_at_start``; it covers every engine the pool
    accepts: the trainer calibrates them, a validator refuses a file that misses one), else
    :data:`UNCALIBRATED_LOWER_DTYPE_SETTINGS`."""
    if dtype == "float32":
        return {}
    calibrated = toploc.thresholds_path is not None or toploc.calibrate_at_start
    settings = LOWER_DTYPE_SETTINGS if calibrated else UNCALIBRATED_LOWER_DTYPE_SETTINGS
    left_out = set(given)
    return {key: value for key, value in settings.items() if key not in left_out}


def lower_dtype_advice(toploc: ToplocConfig, dtype: str) -> str | None:
    """One line for a run generating in ``dtype`` with toploc settings made for float32 (None
    in float32, or once the settings differ from float32's defaults): a config that set them
    so itself, or one built without ``load_config``'s dtype defaults."""
    if dtype == "float32":
        return None
    default = ToplocConfig()
    left = [
        f"toploc.{key} = {settings_literal(value)}"
        for key, value in LOWER_DTYPE_SETTINGS.items()
        if getattr(toploc, key) == getattr(default, key)
    ]
    if not left:
        return None
    return (
        f"the policy runs in {dtype} with toploc's float32 settings: honest units may be "
        "rejected beyond thresholds from few samples, and a float8 or int8 worker may pass "
        f"unit after unit; below float32 they default to {', '.join(left)} (docs/toploc.md, "
        '"int8 below float32")'
    )
