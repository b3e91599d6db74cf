"""Rotary position embedding (RoPE): one rotation, one set of angles, for every path of kvsqueeze.

KVQuant stores keys before RoPE and rotates them at read time (Hooper et al.,
arXiv 2401.18079, Section 3.2), so the cache, the calibration and the kernels
all need the same rotation. Pairs are rotate-half pairs (i, i + D/2), as in
transformers' LLaMA-family models: pair i turns by position * inv_freq[i].

`apply_rope` takes cos / sin either at full width [..., R] (transformers'
convention: the R/2 angles repeated twice) or at half width [..., R/2]; both
give the same bits, because the half-width form is the full-width one with
the repeat left out. R, the rotary width, is the head dimension D unless the
model turns only its first `rotary_dim` channels (partial rotary: Phi,
StableLM), the pairs then being (i, i + R/2) and the other channels passing
unchanged. A layer without RoPE (SmolLM3's NoPE layers) is `Rope.identity`.

`Rope` holds the frequencies and evaluates angles in float64, rounded once to
float32. The model's rotary module rounds position * inv_freq to float32
before the cosine, which at position p moves an angle by up to p * 2^-24 rad
(6e-3 rad at p = 100,000 for the fastest pair); the float64 angle is the exact
one, and every decode backend uses it, so they agree with each other to
float32 rounding and with transformers to that angle error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (split in halves)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _full_width(t: torch.Tensor, d: int) -> torch.Tensor:
    return torch.cat((t, t), dim=-1) if t.shape[-1] * 2 == d else t


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate x [..., D] by cos / sin [..., R] or [..., R/2] (broadcastable to x's leading dimensions).

    Args:
        rotary_dim: R, the leading channels that turn (None: all D); the others pass unchanged.
    """
    return _turn(x, cos, sin, rotary_dim, 1.0)


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Inverse of `apply_rope` for unscaled angles (rotation by the negative angle)."""
    return _turn(x, cos, sin, rotary_dim, -1.0)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None, sign: float):
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rotary_dim must be even and in (0, {d}], got {rotary_dim}")
    if r < d:
        return torch.cat((_turn(x[..., :r], cos, sin, None, sign), x[..., r:]), dim=-1)
    turned = rotate_half(x) * _full_width(sin, d)
    return x * _full_width(cos, d) + turned if sign > 0 else x * _full_width(cos, d) - turned


@dataclass(frozen=True, eq=False)
class Rope:
    """Rotary embedding of one layer: the angle of pair i at position p is p * inv_freq[i].

    Args:
        inv_freq: float32 [R/2], the rotary module's (already rescaled, e.g. llama3 or YaRN) frequencies;
            R = 2 * len(inv_freq) leading channels of a head turn (partial rotary when R < D).
        scaling: multiplies cos and sin (transformers' `attention_scaling`; 1.0 for plain RoPE).
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @classmethod
    def from_rotary(cls, rotary, layer_type: str | None = None) -> Rope:
        """Read the frequencies of a transformers rotary-embedding module (LLaMA, Mistral, Qwen2, ...).

        `layer_type`: for modules that keep one set per layer type (Gemma-3's `sliding_attention` /
        `full_attention`), whose buffers are named `{layer_type}_inv_freq`.
        """
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        if inv_freq is None:
            raise ValueError(f"{type(rotary).__name__} has no `{prefix}inv_freq` buffer: the fused kernels need a "
                             "rotary module whose angles are position * inv_freq (standard RoPE and its rescalings)")
        return cls(inv_freq.detach().float().cpu(), float(getattr(rotary, f"{prefix}attention_scaling", 1.0)))

    @classmethod
    def identity(cls, head_dim: int) -> Rope:
        """No rotation (a layer without RoPE): every pair at angle 0, so cos = 1 and sin = 0 exactly."""
        return cls(torch.zeros(head_dim // 2))

    @classmethod
    def default(cls, head_dim: int, theta: float = 10000.0) -> Rope:
        """Plain RoPE of base `theta` (LLaMA's convention), for tests and benchmarks."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return cls((theta ** -exponent).float())

    @property
    def half(self) -> int:
        return self.inv_freq.numel()

    @functools.cached_property
    def key(self) -> tuple[bytes, float]:
        """The frequencies and scaling by value, which the kernels' RoPE tables are cached by (read once)."""
        return self.inv_freq.cpu().numpy().tobytes(), self.scaling

    @property
    def rotary_dim(self) -> int:
        """R: the leading channels of a head that turn."""
        return 2 * self.half

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, D] turned at `positions` (broadcastable to [..., T]); channels past R pass unchanged."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype), self.rotary_dim)

    def unapply(self, x: torch.Tensor, positions: torch.Tensor, float32_angles: bool = False) -> torch.Tensor:
        """The inverse of `apply`: x [..., T, D] turned back from `positions` (and `scaling` undone).

        `float32_angles`: turn back by angles position * inv_freq rounded in float32, as engines that cache cos
        and sin in float32 (vLLM) turned them; turning back by exactly those leaves no residual rotation (at
        position 500 the float32 angle is off by ~3e-5 rad, enough to move a code that sits on a level
        boundary)."""
        cos, sin = self.cos_sin(positions, float32_angles)  # both carry `scaling`: turning back scales once more
        out = unapply_rope(x, cos.to(x.dtype), sin.to(x.dtype), self.rotary_dim)
        if self.scaling != 1.0:
            r = self.rotary_dim
            out = torch.cat((out[..., :r] / self.scaling**2, out[..., r:]), dim=-1)
        return out

    def cos_sin(self, positions: torch.Tensor, float32_angles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [*positions.shape, D/2] (scaled), angles evaluated in float64 (or float32)."""
        dtype = torch.float32 if float32_angles else torch.float64
        ang = positions.to(dtype).unsqueeze(-1) * self.inv_freq.to(positions.device, dtype)
        return (ang.cos() * self.scaling).float(), (ang.sin() * self.scaling).float()
