"""RoPE angles for the decode kernels: rotate-half pairs (i, i + D/2) turned by position * inv_freq[i].

The kernels re-apply RoPE to pre-RoPE keys at read time (KVQuant, Hooper et al.,
arXiv 2401.18079, Section 3.2), so they need cos/sin of every cached token's
position. Angles are evaluated in float64 and rounded once to float32. The
model's rotary module instead rounds the product position * inv_freq to
float32 before the cosine, which at position p moves an angle by up to
p * 2^-24 rad (6e-3 rad at p = 100,000 for the fastest pair); the float64
angle is the exact one, and both backends use it, so they agree with each
other to float32 rounding and with transformers to that angle error.

`Rope` is what a caller passes (built from the model's rotary module);
`RopeTables` is the factorised form the numba backend reads: cos(p θ) =
cos(hi θ) cos(lo θ) - sin(hi θ) sin(lo θ) with p = hi + lo, lo < `BLOCK`, so a
block of `BLOCK` consecutive positions costs two small table rows instead of
a [positions, D/2] table that would outweigh the packed keys it rotates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 64  # positions per low table: the token block of the numba kernels


@dataclass(frozen=True, eq=False)
class Rope:
    """Rotary embedding of one model: angle of pair i at position p is p * inv_freq[i].

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


@dataclass(frozen=True, eq=False)
class RopeTables:
    """cos/sin factorised over p = hi + lo (hi a multiple of BLOCK), float32 numpy arrays.

    Attributes:
        cos_hi, sin_hi: [rows, D/2] at hi = row * BLOCK, with `scaling` folded in.
        cos_lo, sin_lo: [D/2, BLOCK] at lo = 0..BLOCK-1 (pair-major: a pair's row is contiguous over lo).
    """

    cos_hi: np.ndarray
    sin_hi: np.ndarray
    cos_lo: np.ndarray
    sin_lo: np.ndarray

    @property
    def max_position(self) -> int:
        """Largest position the tables cover."""
        return self.cos_hi.shape[0] * BLOCK - 1


def build_tables(rope: Rope, max_position: int) -> RopeTables:
    """Tables covering positions 0..max_position (rows rounded up to a power of two, so they rarely regrow)."""
    rows = 1 << max(0, int(max_position) // BLOCK).bit_length()
    freq = rope.inv_freq.double().numpy()
    hi = np.arange(rows, dtype=np.float64)[:, None] * BLOCK * freq[None, :]  # [rows, D/2]
    lo = freq[:, None] * np.arange(BLOCK, dtype=np.float64)[None, :]  # [D/2, BLOCK]
    f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
    return RopeTables(f32(np.cos(hi) * rope.scaling), f32(np.sin(hi) * rope.scaling), f32(np.cos(lo)), f32(np.sin(lo)))
