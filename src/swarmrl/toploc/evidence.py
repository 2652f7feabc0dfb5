"""Evidence that accumulates per node: a one-sided CUSUM over each accepted unit's measurements.

Each unit is judged alone against thresholds an honest unit must always meet, so a node whose
units are all slightly off passes every one. Here each accepted unit adds its measurements,
normalised by the threshold each is judged against (1 = at the threshold), to its node's
record (docs/toploc.md, "Evidence that accumulates per node")::

    logprobs   x = mean over tokens of min(2, |reported - replayed| / logprob_tolerance)
    mantissa   x = mean over chunks of mant_err_mean / max_mantissa_mean
    exponents  x = mean over chunks of exp_mismatches / allowed mismatches of the chunk
                   (its compared entries × (1 − min_exponent_matches / topk))

each averaged over the unit's samples, and per measure::

    S_0 = 0,   S_n = max(0, S_{n-1} + x_n − k),   flagged when S_n > h

(k = ``evidence_drift``, h = ``evidence_limit`` or the measure's own
``evidence_measure_limits``; the arithmetic is ``swarmrl.ledger.evidence``).
A node whose units average x̄ > k is flagged after about h / (x̄ − k) units.

With ``evidence_scale`` s > 0 the divisor of each measure is s times the honest mean the
calibration recorded (``evidence_reference``), never below :data:`REFERENCE_FLOOR` of the
threshold (:func:`units`): thresholds grow with the number of calibration samples (they bound
the worst honest value), means hardly move (docs/toploc.md, "Evidence in reference units").
Where the calibration measured each pairing of engines, a unit is measured against the means
of its own pairing (the engine its node declared, the validator's), so a node is compared with
honest nodes on the same engines rather than with the loosest pairing.

A validator sends each accepted unit's measurements with its verdict (``Verdict.evidence``) and
the pool keeps one record per node in its database, across validators and restarts
(``swarmrl.pool.trust.evidence``); :class:`NodeEvidence` keeps records in this process's memory
for a judge without a pool. Knows nothing about HTTP or pools.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import get_args

from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import UserError
from swarmrl.ledger.evidence import Cusum, add_unit
from swarmrl.protocol.pool import EVIDENCE_CAP, EvidenceMeasure
from swarmrl.protocol.proofs import ProofVerdict

TOKEN_CAP = EVIDENCE_CAP  # a token's or chunk's term counts at most this many units
REFERENCE_FLOOR = 0.05  # in reference units, a unit is at least this share of the threshold
MEASURES: tuple[EvidenceMeasure, ...] = get_args(EvidenceMeasure)


def units(config: ToplocConfig, pairing: str | None = None) -> dict[EvidenceMeasure, float]:
    """What one unit of each measure is, in the measure's own units (nats per token, ulps per
    chunk, share of a chunk's exponents that differ): its threshold (``evidence_scale`` 0), or
    ``evidence_scale`` times the calibration's honest mean, never below
    :data:`REFERENCE_FLOOR` of the threshold (a mean near 0, an engine replaying itself bit
    for bit, would otherwise count every honest rounding of another engine as a shift).

    ``pairing`` ("worker->validator": the engine the unit's node declared, the one that
    replayed it): the honest means of that pairing where the calibration recorded them
    (``evidence_pairing_references``), else ``evidence_reference`` (in a calibration across
    engines, the loosest pairing's)."""
    thresholds: dict[EvidenceMeasure, float] = {
        "logprobs": config.logprob_tolerance,
        "mantissa": config.max_mantissa_mean,
        "exponents": 1.0 - config.min_exponent_matches / config.topk,
    }
    if config.evidence_scale <= 0:
        return thresholds
    reference = {  # a measure the pairing lacks: the loosest pairing's
        **(config.evidence_reference or {}),
        **config.evidence_pairing_references.get(pairing or "", {}),
    }
    missing = [m for m in MEASURES if m not in reference]
    if missing:
        raise UserError(
            f"toploc.evidence_scale > 0 needs the calibration's honest mean of {missing} "
            "(evidence_reference: a thresholds file written by `swarmrl toploc calibrate` "
            "or the run-start calibration of this version), or toploc.evidence_scale = 0 to "
            "measure in shares of the thresholds"
        )
    return {
        m: max(config.evidence_scale * reference[m], REFERENCE_FLOOR * t)
        for m, t in thresholds.items()
    }


def unit_measures(
    verdicts: Sequence[ProofVerdict],
    reported: Sequence[Sequence[float]],
    config: ToplocConfig,
    pairing: str | None = None,
) -> dict[EvidenceMeasure, float]:
    """The normalised measurements of one accepted unit (module docstring); ``reported``: each
    sample's log-probs as the worker reported them ([n] per sample); ``pairing``: whose honest
    means are the unit (:func:`units`). A measure no sample of the unit has (no chunk
    compared, no token) is left out."""
    if not verdicts:
        return {}
    per_sample: dict[EvidenceMeasure, list[float]] = {m: [] for m in MEASURES}
    unit = units(config, pairing)
    for verdict, claimed in zip(verdicts, reported, strict=True):
        replayed = verdict.behaviour_logprobs or []
        if replayed and unit["logprobs"] > 0:
            terms = [
                min(TOKEN_CAP, abs(c - r) / unit["logprobs"])
                for c, r in zip(claimed, replayed, strict=True)
            ]
            per_sample["logprobs"].append(sum(terms) / len(terms))
        chunks = [c for c in verdict.chunks if c.compared > 0]
        if chunks and unit["mantissa"] > 0:
            errors = [c.mant_err_mean if c.mant_err_mean is not None else math.inf for c in chunks]
            mean = sum(min(TOKEN_CAP, e / unit["mantissa"]) for e in errors)
            per_sample["mantissa"].append(mean / len(chunks))
        if chunks and unit["exponents"] > 0:
            shares = [
                min(TOKEN_CAP, c.exp_mismatches / (c.compared * unit["exponents"])) for c in chunks
            ]
            per_sample["exponents"].append(sum(shares) / len(shares))
    return {m: sum(xs) / len(xs) for m, xs in per_sample.items() if xs}


@dataclass
class NodeEvidence:
    """The records of every node this validator has judged, by node id."""

    drift: float
    limit: float
    limits: dict[str, float] = field(default_factory=dict)  # a measure's own limit
    records: dict[str, dict[str, Cusum]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: ToplocConfig) -> NodeEvidence:
        return cls(
            config.evidence_drift, config.evidence_limit, dict(config.evidence_measure_limits)
        )

    def add(self, node_id: str, measures: Mapping[str, float]) -> str | None:
        """Add one accepted unit of ``node_id``; the reason it is flagged (one line), or None.
        A limit of 0 keeps records and flags nobody."""
        record = self.records.setdefault(node_id, {})
        return add_unit(record, measures, self.drift, self.limit, self.limits)
