"""TurboQuant (Zandieh et al., ICLR 2026, arXiv 2504.19874), its MSE quantizer, as a data-oblivious baseline.

Each head vector x of D channels is stored as its norm (fp16) and the codes of
its direction turned by a fixed random rotation R: y = (x / |x|) R. Whatever
x is, the coordinates of a uniformly rotated unit vector all follow the same
law, the density (1 - t^2)^((D - 3) / 2) on [-1, 1] (about N(0, 1/D)), so one
scalar codebook serves every coordinate of every vector: the Lloyd-Max
quantizer of that density at b bits (`sphere_levels`), computed here by Lloyd
iterations on a fine grid. Decoding is |x| * (levels[codes] R^T). Nothing is
calibrated.

The paper's 2.5- and 3.5-bit variants split each head's channels into outlier
and regular ones and run two independent instances, the outliers one bit
wider. Here (`split`) the outliers are the half of each head's channels with
the largest RMS over the tokens of the cache's first update, the prompt, as an
engine choosing them when it prefills would; b bits then average b + 0.5, plus
one fp16 norm per half-vector.

The QJL residual bit of the paper's inner-product variant is not implemented:
its estimator is unbiased for a dot product but adds variance, and the paper's
KV-cache results use the MSE quantizer with outlier splitting.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

GRID = 1 << 16  # points of the grid the Lloyd iterations run on
ITERATIONS = 20_000  # Lloyd converges slowly in the tails; it stops once the levels no longer move


@functools.cache
def sphere_levels(bits: int, dim: int) -> torch.Tensor:
    """The Lloyd-Max levels (float32, 2**bits, ascending) of one coordinate of a uniform unit vector in R^dim."""
    if dim < 2:
        raise ValueError(f"TurboQuant needs vectors of 2 or more channels, got {dim}")
    lim = min(1.0, 12 / math.sqrt(dim))  # the density is negligible past 12 standard deviations
    t = torch.linspace(-lim, lim, GRID + 2, dtype=torch.float64)[1:-1]
    w = (1 - t * t).clamp_min(0) ** ((dim - 3) / 2)
    w = w / w.sum()
    cdf = w.cumsum(0)
    n = 2**bits
    levels = t[torch.searchsorted(cdf, (torch.arange(n, dtype=torch.float64) + 0.5) / n).clamp(max=t.numel() - 1)]
    for _ in range(ITERATIONS):
        cell = torch.bucketize(t, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w * t)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
        if float((new - levels).abs().max()) < 1e-9 / math.sqrt(dim):
            break
        levels = new
    return levels.float()


def random_rotation(dim: int, seed: int) -> torch.Tensor:
    """A random orthogonal matrix [dim, dim] (float32; Haar-distributed: QR of a Gaussian, signs fixed)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _quantize_directions(x: torch.Tensor, rotation: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """x [..., D] through norm (fp16) + rotated scalar codes, and back."""
    norm = x.norm(dim=-1, keepdim=True)
    stored = norm.half().float()
    y = (x / norm.clamp_min(torch.finfo(torch.float32).tiny)) @ rotation
    codes = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)
    return (levels[codes] @ rotation.T) * stored


@dataclass(eq=False)
class TurboQuantizer:
    """TurboQuant-MSE for one tensor of one layer: vectors [N, C] of `heads` heads of `head_dim` channels.

    `fake` has the interface of `quantizer.VectorQuantizer.fake` (it keeps no outliers); `reset` starts a new
    cache (a new prompt picks the outlier channels again where `split`).
    """

    bits: int
    head_dim: int
    seed: int
    split: bool = False
    fraction: float = 0.0  # no exact outliers (the interface the simulation reads)
    _outliers: torch.Tensor | None = field(default=None, repr=False)  # bool [H, D] once a prompt chose them

    def __post_init__(self) -> None:
        if self.split and self.head_dim % 2:
            raise ValueError(f"the outlier split halves each head: head_dim {self.head_dim} is odd")
        half = self.head_dim // 2
        if self.split:
            self._parts = ((random_rotation(half, self.seed), sphere_levels(self.bits + 1, half)),
                           (random_rotation(half, self.seed + 1), sphere_levels(self.bits, half)))
        else:
            self._parts = ((random_rotation(self.head_dim, self.seed), sphere_levels(self.bits, self.head_dim)),)

    def reset(self) -> None:
        self._outliers = None

    def fake(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Quantize and dequantize x [N, C] (C a multiple of head_dim); returns (x_hat, 0)."""
        n, c = x.shape
        if c % self.head_dim:
            raise ValueError(f"{c} channels are not whole heads of {self.head_dim}")
        v = x.float().view(n, c // self.head_dim, self.head_dim)  # [N, H, D]
        dev = v.device
        if not self.split:
            rot, lev = self._parts[0]
            return _quantize_directions(v, rot.to(dev), lev.to(dev)).view(n, c).to(x.dtype), 0
        if self._outliers is None:
            rms = v.pow(2).mean(0)  # [H, D], over the prompt's tokens
            top = rms.topk(self.head_dim // 2, dim=-1).indices
            self._outliers = torch.zeros_like(rms, dtype=torch.bool).scatter_(1, top, True)
        mask = self._outliers.to(dev)
        out = torch.empty_like(v)
        h, d = mask.shape
        for chosen, (rot, lev) in zip((mask, ~mask), self._parts):
            idx = chosen.nonzero(as_tuple=True)[1].view(h, d // 2)  # each head's channels of this part, in order
            part = v.gather(2, idx.expand(n, h, d // 2))
            out.scatter_(2, idx.expand(n, h, d // 2), _quantize_directions(part, rot.to(dev), lev.to(dev)))
        return out.view(n, c).to(x.dtype), 0

    @property
    def avg_code_bits(self) -> float:
        return self.bits + (0.5 if self.split else 0.0)
