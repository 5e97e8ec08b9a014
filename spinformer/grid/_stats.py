"""Confidence intervals of a grid's paired gaps (seeds are few, so Student's t)."""

from __future__ import annotations

import math

import numpy as np

# two-sided 95 % quantiles of Student's t by degrees of freedom (a missing df takes the
# nearest smaller one: slightly conservative)
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 19: 2.09, 29: 2.05}


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with `df` ≥ 1 degrees of freedom."""
    return T975.get(df) or T975[max(k for k in T975 if k <= df)]


def mean_ci(values) -> tuple[float, float]:
    """`(mean, half-width of its 95 % t-interval)`; the half-width is NaN for fewer than two
    values (and the mean NaN for none)."""
    v = np.asarray(values, float)
    if len(v) < 2:
        return (float(v.mean()) if len(v) else float("nan")), float("nan")
    return float(v.mean()), t975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
