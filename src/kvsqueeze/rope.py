"""Rotary position embedding (RoPE): one rotation, one set of angles, for every path of kvsqueeze.

KVQuant stores keys before RoPE and rotates them at read time (Hooper et al.,
arXiv 2401.18079, Section 3.2), so the cache, the calibration and the kernels
all need the same rotation. Pairs are rotate-half pairs (i, i + D/2), as in
transformers' LLaMA-family models: pair i turns by position * inv_freq[i].

`apply_rope` takes cos / sin either at full width [..., D] (transformers'
convention: the D/2 angles repeated twice) or at half width [..., D/2]; both
give the same bits, because the half-width form is the full-width one with
the repeat left out.

`Rope` holds the frequencies and evaluates angles in float64, rounded once to
float32. The model's rotary module rounds position * inv_freq to float32
before the cosine, which at position p moves an angle by up to p * 2^-24 rad
(6e-3 rad at p = 100,000 for the fastest pair); the float64 angle is the exact
one, and every decode backend uses it, so they agree with each other to
float32 rounding and with transformers to that angle error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (split in halves)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _full_width(t: torch.Tensor, d: int) -> torch.Tensor:
    return torch.cat((t, t), dim=-1) if t.shape[-1] * 2 == d else t


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., D] by cos / sin [..., D] or [..., D/2] (broadcastable to x's leading dimensions)."""
    d = x.shape[-1]
    return x * _full_width(cos, d) + rotate_half(x) * _full_width(sin, d)


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` for unscaled angles (rotation by the negative angle)."""
    d = x.shape[-1]
    return x * _full_width(cos, d) - rotate_half(x) * _full_width(sin, d)


@dataclass(frozen=True, eq=False)
class Rope:
    """Rotary embedding of one model: the angle of pair i at position p is p * inv_freq[i].

    Args:
        inv_freq: float32 [D/2], the rotary module's (already rescaled, e.g. llama3 or YaRN) frequencies.
        scaling: multiplies cos and sin (transformers' `attention_scaling`; 1.0 for plain RoPE).
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @classmethod
    def from_rotary(cls, rotary) -> Rope:
        """Read the frequencies of a transformers rotary-embedding module (LLaMA, Mistral, Qwen2, ...)."""
        inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise ValueError(f"{type(rotary).__name__} has no `inv_freq` buffer: the fused kernels need a "
                             "rotary module whose angles are position * inv_freq (standard RoPE and its rescalings)")
        return cls(inv_freq.detach().float().cpu(), float(getattr(rotary, "attention_scaling", 1.0)))

    @classmethod
    def default(cls, head_dim: int, theta: float = 10000.0) -> Rope:
        """Plain RoPE of base `theta` (LLaMA's convention), for tests and benchmarks."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return cls((theta ** -exponent).float())

    @property
    def half(self) -> int:
        return self.inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [*positions.shape, D/2] (scaled), angles evaluated in float64."""
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device, torch.float64)
        return (ang.cos() * self.scaling).float(), (ang.sin() * self.scaling).float()
