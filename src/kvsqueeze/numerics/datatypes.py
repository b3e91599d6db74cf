"""Quantization levels: uniform intX, NormalFloat nfX and learned nuqX codebooks.

Every datatype here is a sorted set of levels inside [-1, 1]; a vector is
normalized to that interval by its scale and zero-point (`quantizer.py`), so
uniform, NormalFloat and learned non-uniform quantization share one code path.
NormalFloat follows QLoRA (Dettmers et al., 2023); learned codebooks come from
the Fisher-weighted k-means of KVQuant (Hooper et al., NeurIPS 2024).
"""

from __future__ import annotations

import torch


def uniform_levels(bits: int) -> torch.Tensor:
    """2**bits evenly spaced levels from -1 to 1 (asymmetric uniform intX), float32 [2**bits]."""
    _check_bits(bits)
    return torch.linspace(-1.0, 1.0, 2**bits, dtype=torch.float64).float()


def normal_float_levels(bits: int) -> torch.Tensor:
    """NormalFloat levels (quantiles of N(0, 1)) scaled into [-1, 1], float32 [2**bits].

    As in QLoRA: 2**(b-1) positive and 2**(b-1) - 1 negative quantiles plus an
    exact zero, each side evenly spaced in probability up to the offset that
    puts the extreme levels at the edges of the outermost bins.
    """
    _check_bits(bits)
    if bits < 2:
        raise ValueError("NormalFloat needs at least 2 bits (1 bit cannot hold both signs and zero)")
    n = 2**bits
    offset = 1.0 - 0.5 * (1.0 / (2 * (n - 1)) + 1.0 / (2 * n))
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (levels / levels.abs().max()).float()


STANDARD_LEVELS = {"int": uniform_levels, "nf": normal_float_levels}


def standard_levels(family: str, bits: int) -> torch.Tensor:
    """Levels of a datatype that needs no calibration ("int" or "nf")."""
    if family not in STANDARD_LEVELS:
        raise ValueError(f"datatype {family!r} has no standard levels (it is calibrated); standard ones are {sorted(STANDARD_LEVELS)}")
    return STANDARD_LEVELS[family](bits)


def check_codebook(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Validate a learned codebook: 2**bits finite sorted levels inside [-1, 1]."""
    if levels.ndim != 1 or levels.numel() != 2**bits:
        raise ValueError(f"a {bits}-bit codebook needs {2**bits} levels, got shape {tuple(levels.shape)}")
    if not torch.isfinite(levels).all():
        raise ValueError("codebook holds NaN or Inf levels; recalibrate the recipe")
    if (levels.diff() < 0).any() or levels.min() < -1 - 1e-6 or levels.max() > 1 + 1e-6:
        raise ValueError("codebook levels must be sorted and inside [-1, 1]; recalibrate the recipe")
    return levels.float()


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bit width must be an integer in 1..8, got {bits!r}")
