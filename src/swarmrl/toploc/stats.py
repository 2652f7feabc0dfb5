"""Per-chunk agreement statistics between a prover's committed bf16 patterns and the validator's.

For bf16 patterns b (16-bit): exponent(b) = (b & 0x7F80) >> 7, mantissa(b) = b & 0x7F.
At each of the validator's top-k indices i of a chunk, the prover's value is P(i mod m)::

    exp_mismatches  = #{ i : exponent(P(i mod m)) != exponent(v_i) }
    mant_err        = { |mantissa(P(i mod m)) - mantissa(v_i)| : exponents equal }
    mant_err_mean   = mean(mant_err)
    mant_err_median = sorted(mant_err)[len // 2]     (upper median, as the reference C++ path)

Both are +inf when no exponent matches. An index the prover did not commit evaluates to an
essentially random field element, so disagreement about the top-k set itself shows up as
exponent mismatches. The sign bit is not compared (as in the reference).

Knows nothing about polynomials, models or thresholds.
"""

from __future__ import annotations

import numpy as np

EXPONENT_MASK = 0x7F80
MANTISSA_MASK = 0x007F


def chunk_statistics(
    prover: np.ndarray, validator: np.ndarray, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exp_mismatches int64 [C], mant_err_mean float64 [C], mant_err_median float64 [C]).

    prover, validator: [C, k] 16-bit patterns; valid: [C, k] bool, False on padding entries
    (chunks holding fewer than k values).
    """
    prover = np.asarray(prover, dtype=np.int64)
    validator = np.asarray(validator, dtype=np.int64)
    exp_equal = ((prover & EXPONENT_MASK) >> 7) == ((validator & EXPONENT_MASK) >> 7)
    mismatches = (valid & ~exp_equal).sum(axis=1)
    counted = valid & exp_equal  # [C, k]
    errors = np.abs((prover & MANTISSA_MASK) - (validator & MANTISSA_MASK)).astype(np.float64)
    n = counted.sum(axis=1)  # [C]
    total = np.where(counted, errors, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, total / np.maximum(n, 1), np.inf)
    ordered = np.sort(np.where(counted, errors, np.inf), axis=1)  # uncounted sort last
    middle = np.take_along_axis(ordered, (n // 2)[:, None].clip(max=ordered.shape[1] - 1), 1)
    median = np.where(n > 0, middle[:, 0], np.inf)
    return mismatches, mean, median
