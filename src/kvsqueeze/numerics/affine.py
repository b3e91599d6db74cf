"""Scale/zero-point quantization onto sorted levels in [-1, 1] (pure torch).

A vector x is normalized as (x - z) / s with z = (hi + lo) / 2 and
s = (hi - lo) / 2, so its clipping range [lo, hi] maps onto [-1, 1]; each
element takes the nearest level and dequantizes as s * level + z. Scales and
zero-points are rounded to fp16 because that is how they are stored (KVQuant
keeps key zero-points in fp16: some channels are all-positive or all-negative).
Which axis shares one (s, z) is decided by the caller through the shapes of
`lo` and `hi`, which broadcast against x.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0  # the largest finite float16: the scales, zero-points, outliers and sinks caches store

_MIN_SCALE = 1e-6  # a constant vector still needs a non-zero scale


def choose_qparams(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero-point (fp16-rounded, returned as float32) for clipping range [lo, hi]."""
    zero = ((hi + lo) * 0.5).half().float()
    scale = ((hi - lo) * 0.5).clamp_min(_MIN_SCALE).half().float().clamp_min(_MIN_SCALE)
    return scale, zero


def normalize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(x - zero) / scale, the domain the levels live in."""
    return (x - zero) / scale


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Nearest-level codes (uint8, same shape as x) of x normalized by scale and zero.

    Values outside [-1, 1] after normalization clip to the end levels.
    """
    norm = normalize(x.float(), scale, zero)
    mids = (levels[1:] + levels[:-1]) * 0.5
    return torch.bucketize(norm.contiguous(), mids.to(norm.device)).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """s * levels[codes] + z, float32; levels [L], or [C, L] with a codebook per channel (the last axis of codes)."""
    levels = levels.to(scale.device)
    if levels.dim() == 2:
        return levels[torch.arange(levels.shape[0], device=levels.device), codes.long()] * scale + zero
    return levels[codes.long()] * scale + zero


def fake_quantize(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    levels: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize then dequantize x with clipping range [lo, hi]; `keep` elements stay exact in fp16.

    Args:
        x: float tensor, any shape.
        lo, hi: clipping range, broadcastable to x.
        levels: sorted levels in [-1, 1], float32 [2**bits].
        keep: optional bool mask broadcastable to x: elements stored exactly
            (outliers, sinks), returned rounded to fp16 as they are stored.
    """
    scale, zero = choose_qparams(lo, hi)
    xq = dequantize(quantize(x, scale, zero, levels), scale, zero, levels).to(x.dtype)
    if keep is not None:
        xq = torch.where(keep, x.half().to(x.dtype), xq)
    return xq


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise a clear error when activations hold NaN or Inf (quantizing them would hide the problem)."""
    if not torch.isfinite(x.sum()):  # NaN and Inf propagate through a sum: one cheap reduction
        if torch.isfinite(x).all():
            return  # finite values whose sum overflowed
        bad = (~torch.isfinite(x)).sum().item()
        wider = ("load the model in float32 or bfloat16, or check the input" if x.dtype == torch.float16 else
                 "the model overflowed in its own dtype: check its weights and the input")
        raise FloatingPointError(
            f"{what} holds {bad} NaN/Inf values ({x.dtype}); the model's activations overflowed before "
            f"quantization ({wider})"
        )
