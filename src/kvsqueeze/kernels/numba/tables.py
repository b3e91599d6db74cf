"""RoPE tables of the numba kernels: cos / sin factorised over p = hi + lo with lo < `BLOCK`.

cos(p θ) = cos(hi θ) cos(lo θ) - sin(hi θ) sin(lo θ) with p = hi + lo, so a
block of `BLOCK` consecutive positions costs two small table rows instead of
a [positions, D/2] table that would outweigh the packed keys it rotates.
Angles are evaluated in float64 and rounded once to float32, as `Rope.cos_sin`
does (`kvsqueeze.numerics.rope`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...numerics.rope import Rope

BLOCK = 64  # positions per low table: the token block of the numba kernels


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
    f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    return RopeTables(f32(np.cos(hi) * rope.scaling), f32(np.sin(hi) * rope.scaling), f32(np.cos(lo)), f32(np.sin(lo)))
