"""Outlier thresholds for dense-and-sparse quantization (KVQuant Section 3.5).

Elements outside a vector's thresholds are kept exactly (fp16, with their
index) and the rest are quantized inside the narrowed range. Thresholds are
per vector (per channel for keys, per token for values: the same vectors that
share a scale) or, for the ablation, one pair per matrix. Offline thresholds
are quantiles over calibration data; online ones are top-k per token.
"""

from __future__ import annotations

import math

import torch


def max_outliers_per_side(fraction: float, width: int) -> int:
    """Outliers kept on each side (above / below) of one vector of `width` elements."""
    return int(math.floor(fraction * width / 2 + 0.5))


def topk_per_side(fraction: float, width: int) -> int:
    """Outliers an online per-vector top-k keeps above (and below) one vector: at most half of it."""
    return min(max_outliers_per_side(fraction, width), (width - 1) // 2)


def fixed_outlier_count(axis: str, scope: str, fraction: float) -> bool:
    """Whether every vector keeps the same number of outliers: per-token top-k (row pointers then implicit)."""
    return axis == "token" and scope == "vector" and fraction > 0


def online_thresholds(x: torch.Tensor, fraction: float, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector range [lo, hi] leaving the `fraction` largest-magnitude tails out (half each side).

    Args:
        x: float tensor; vectors run along `dim`.
        fraction: share of each vector's elements to treat as outliers.
    Returns:
        lo, hi with `dim` kept as size 1. With k = round(fraction * n / 2)
        outliers per side, hi is the (k+1)-th largest element and lo the
        (k+1)-th smallest, so at most k elements lie strictly above / below.
    """
    n = x.shape[dim]
    k = topk_per_side(fraction, n)
    if k == 0:
        return x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    hi = x.topk(k + 1, dim=dim).values.narrow(dim, k, 1)
    lo = x.topk(k + 1, dim=dim, largest=False).values.narrow(dim, k, 1)
    return lo, hi


def calibrated_thresholds(x: torch.Tensor, fraction: float, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline per-vector range from calibration samples: the fraction/2 and 1 - fraction/2 quantiles.

    Args:
        x: float tensor [N, C] of calibration activations (dim=0 reduces over
            the N samples, giving one range per channel), or any shape with
            `dim=None` for one per-matrix range.
    Returns:
        lo, hi: float32 tensors [C] (or scalars for dim=None).
    """
    per_matrix = dim is None
    # vectors along the last, contiguous axis: a partial sort of the k + 1 tail elements per side (topk) is many
    # times faster there than an order statistic over a strided axis, and returns the same elements
    x = x.reshape(1, -1) if per_matrix else x.movedim(dim, -1).contiguous()
    x = x.float()
    n = x.shape[-1]
    k = int(round(fraction / 2 * n))
    if k == 0:
        lo, hi = x.amin(-1), x.amax(-1)
    else:
        lo = x.topk(k + 1, dim=-1, largest=False).values[..., k]  # the (k+1)-th smallest
        hi = x.topk(k + 1, dim=-1).values[..., k]  # the (k+1)-th largest, the (n-k)-th smallest
    return (lo.squeeze(), hi.squeeze()) if per_matrix else (lo, hi)


def outlier_mask(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """True where x lies strictly outside [lo, hi]: those elements are stored exactly."""
    return (x < lo) | (x > hi)


def clamp_range(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector range of x along `dim` narrowed by (per-matrix) thresholds: [max(min, lo), min(max, hi)]."""
    vmin = x.amin(dim, keepdim=True)
    vmax = x.amax(dim, keepdim=True)
    return torch.maximum(vmin, lo), torch.minimum(vmax, hi)
