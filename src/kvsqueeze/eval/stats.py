"""Intervals over clusters: the evaluation windows of a perplexity run, the samples of a RULER-style run.

Tokens of one window share a text and a cache, and questions of one sample share a prefill: they are not
independent draws, so every interval here is taken over clusters, each known only by the sum of its values and
their count. With few clusters (the 3-8 windows a perplexity table is measured on) a percentile bootstrap over
them is far narrower than their spread warrants (over five windows its nominal 95% covers about 84% of the
time, over three about 75%: `experiments/interval_coverage.py`); Student's t on clusters - 1 degrees of freedom
keeps 95%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Student's t, 97.5th percentile, by degrees of freedom (beyond the table: its expansion in 1 / df)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t quantile 0.975 with `df` degrees of freedom (df >= 1)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def cluster_interval(sums: Sequence[float], counts: Sequence[float], lo: float = -math.inf,
                     hi: float = math.inf) -> tuple[float, float] | None:
    """95% interval of sum(sums) / sum(counts), a mean over values drawn in clusters (cluster i: its values'
    sum and count), from the clusters' spread: the cluster-robust standard error of a ratio, with Student's t on
    clusters - 1 degrees of freedom, clipped to [lo, hi]. None for fewer than two clusters."""
    n = len(sums)
    if n < 2:
        return None
    total = sum(counts)
    mean = sum(sums) / total
    var = n / (n - 1) * sum((s - mean * k) ** 2 for s, k in zip(sums, counts)) / total**2
    half = t975(n - 1) * math.sqrt(var)
    return max(lo, mean - half), min(hi, mean + half)
