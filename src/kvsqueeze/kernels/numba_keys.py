"""Key side of the numba decode kernel: scores over packed keys, sinks, softmax (outliers: `numba_sparse`).

See `numba_cpu.py` for the order of the passes and `numba_common.py` for the layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numba_common import TILE, ZERO, cos_sin_at, decode, gather_words, rope_block
from .rope import BLOCK
from .simd import (
    LANES,
    f16,
    vfma,
    vfms,
    vhmax,
    vload,
    vmax,
    vmul,
    vsplat,
    vstore_first,
)


@njit(parallel=True, cache=True)
def key_scores(q, codes, klut, bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, starts, scores):
    """scores[b, hq, t] = scaling * q[b, hq] . RoPE(LUT-dequantized key of token t, KV head hq // G).

    Args:
        q: float32 [B, Hq, D]; codes: uint32 [T, B, W]; klut: float32 [C, 16] per-channel tables.
        positions: int32 [T, B]; cos_hi .. sin_lo: `rope.RopeTables`.
        starts: int64 [items + 1], the token ranges of the work items of every row.
        scores: float32 [B, Hq, T], written.
    """
    n_tok, n_rows, _ = codes.shape
    hq_all, d = q.shape[1], q.shape[2]
    g_size = hq_all // heads
    half = d // 2
    n_items = starts.shape[0] - 1
    max_words = ((d * bits + 31) >> 5) + 2  # a head's words, and one more that `decode` reads
    vscale = vsplat(scaling)
    for item in prange(n_rows * n_items):
        b = item // n_items
        first, last = starts[item % n_items], starts[item % n_items + 1]
        wb = np.empty((max_words, BLOCK), np.uint32)
        cs = np.empty((half, BLOCK), np.float32)
        sn = np.empty((half, BLOCK), np.float32)
        for t0 in range(first, last, BLOCK):
            n = min(BLOCK, last - t0)
            rope_block(positions, b, t0, n, cos_hi, sin_hi, cos_lo, sin_lo, cs, sn)
            for h in range(heads):
                w0 = (h * d * bits) >> 5
                gather_words(codes, b, t0, n, w0, (((h + 1) * d * bits - 1) >> 5) - w0 + 1, wb, BLOCK)
                for gt in range(0, g_size, TILE):
                    _dot_group(q, b, h * g_size + gt, min(TILE, g_size - gt), wb, w0, h * d, half, bits, klut,
                               cs, sn, n, vscale, scores, ((b * hq_all) + h * g_size + gt) * n_tok + t0, n_tok)


@njit(cache=True, inline="always")
def _fma_pair(q, b, hq, j, half, xr, yr, acc):
    return vfma(vsplat(q[b, hq, j + half]), yr, vfma(vsplat(q[b, hq, j]), xr, acc))


@njit(cache=True, inline="always")
def _dot_group(q, b, qh, ng, wb, w0, c0, half, bits, klut, cs, sn, n, vscale, scores, base, n_tok):
    """Scores of query heads qh..qh+ng (ng <= 4) for one block: 32 tokens (two vectors) per pass over the pairs.

    Accumulators stay in registers; each pair (j, j + D/2) of the head's channels is decoded, rotated and
    multiplied into every query head of the tile.
    """
    for k in range(0, n, 2 * LANES):
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vsplat(ZERO)
        for j in range(half):
            x0 = decode(wb, BLOCK, w0, c0 + j, bits, klut, c0 + j, k)
            y0 = decode(wb, BLOCK, w0, c0 + j + half, bits, klut, c0 + j + half, k)
            x1 = decode(wb, BLOCK, w0, c0 + j, bits, klut, c0 + j, k + LANES)
            y1 = decode(wb, BLOCK, w0, c0 + j + half, bits, klut, c0 + j + half, k + LANES)
            c, s = vload(cs, j * BLOCK + k), vload(sn, j * BLOCK + k)
            xr0, yr0 = vfms(x0, c, vmul(y0, s)), vfma(y0, c, vmul(x0, s))
            c, s = vload(cs, j * BLOCK + k + LANES), vload(sn, j * BLOCK + k + LANES)
            xr1, yr1 = vfms(x1, c, vmul(y1, s)), vfma(y1, c, vmul(x1, s))
            a0, b0 = _fma_pair(q, b, qh, j, half, xr0, yr0, a0), _fma_pair(q, b, qh, j, half, xr1, yr1, b0)
            if ng > 1:
                a1, b1 = _fma_pair(q, b, qh + 1, j, half, xr0, yr0, a1), _fma_pair(q, b, qh + 1, j, half, xr1, yr1, b1)
            if ng > 2:
                a2, b2 = _fma_pair(q, b, qh + 2, j, half, xr0, yr0, a2), _fma_pair(q, b, qh + 2, j, half, xr1, yr1, b2)
            if ng > 3:
                a3, b3 = _fma_pair(q, b, qh + 3, j, half, xr0, yr0, a3), _fma_pair(q, b, qh + 3, j, half, xr1, yr1, b3)
        for g, (lo, hi) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
            if g < ng:
                vstore_first(scores, base + g * n_tok + k, vmul(lo, vscale), n - k)
                vstore_first(scores, base + g * n_tok + k + LANES, vmul(hi, vscale), n - k - LANES)


@njit(cache=True)
def sink_scores(q, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, sink_k, sink_slot, scores):
    """Overwrite the scores of sink tokens with those of their exact keys (fp16 bits, uint16 [B, S, C], pre-RoPE)."""
    hq_all, d = q.shape[1], q.shape[2]
    g_size = hq_all // heads
    half = d // 2
    for b in range(sink_slot.shape[0]):
        for s in range(sink_slot.shape[1]):
            t = sink_slot[b, s]
            if t < 0:
                continue
            for hq in range(hq_all):
                base = (hq // g_size) * d
                acc = ZERO
                for j in range(half):
                    cos, sin = cos_sin_at(positions[t, b], j, cos_hi, sin_hi, cos_lo, sin_lo)
                    x, y = f16(sink_k[b, s, base + j]), f16(sink_k[b, s, base + j + half])
                    acc += q[b, hq, j] * (x * cos - y * sin) + q[b, hq, j + half] * (y * cos + x * sin)
                scores[b, hq, t] = acc * scaling


@njit(parallel=True, cache=True)
def row_max(scores, bias, m):
    """m[b, hq] = max over T of scores[b, hq] + bias[b], the bias added in place (bias float32 [B, T] of
    0 / -inf, or [0, 0]: none). The softmax itself happens in the value pass: exp(score - m) there."""
    n_rows, hq_all, n_tok = scores.shape
    full = n_tok // LANES * LANES
    for r in prange(n_rows * hq_all):
        row = r * n_tok
        flat = scores.reshape(-1)
        if bias.shape[0]:
            brow = bias[r // hq_all]
            for t in range(n_tok):
                flat[row + t] += brow[t]
        vm = vsplat(np.float32(-np.inf))
        for k in range(0, full, LANES):
            vm = vmax(vm, vload(scores, row + k))
        top = vhmax(vm)
        for t in range(full, n_tok):
            top = max(top, flat[row + t])
        m[r // hq_all, r % hq_all] = top
