"""Value side of the numba decode kernel: weights times packed values, sinks (outliers: `numba_sparse`).

See `numba_cpu.py` for the order of the passes and `numba_common.py` for the layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numba_common import SPAN, TILE, ZERO, code_at, decode, gather_words
from .simd import LANES, f16, vfma, vhsum, vload, vload_first, vmul, vstore


# ---- values ------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def value_sums(probs, codes, vlut, bits, heads, scale_zero, starts, partial):
    """partial[b, h, item, g, :] = sum over the item's tokens of probs * dequantized value, values read packed.

    A value is level[code] * s_t + z_t; sum_t p_t v_t is accumulated as sum_t (p_t s_t) level[code] +
    sum_t p_t z_t.

    Args:
        probs: float32 [B, Hq, T]; codes: uint32 [T, B, W]; vlut: float32 [1, 16] (levels, padded).
        scale_zero: fp16 bits, uint16 [T, B, 2]; starts: int64 [items + 1], the token ranges of the work items.
        partial: float32 [B, H, items, G, D], written.
    """
    n_tok, n_rows, _ = codes.shape
    hq_all = probs.shape[1]
    g_size = hq_all // heads
    d, n_items = partial.shape[4], partial.shape[2]
    max_words = ((d * bits + 31) >> 5) + 1
    for item in prange(n_rows * heads * n_items):
        b = item // (heads * n_items)
        h = (item // n_items) % heads
        ck = item % n_items
        first, last = starts[ck], starts[ck + 1]
        w0 = (h * d * bits) >> 5
        nw = (((h + 1) * d * bits - 1) >> 5) - w0 + 1
        wb = np.empty((max_words, SPAN), np.uint32)
        weights = np.empty((g_size, SPAN), np.float32)  # probs * s_t
        sbuf = np.empty(SPAN, np.float32)
        zbuf = np.empty(SPAN, np.float32)
        acc = np.zeros((g_size, d, LANES), np.float32)
        zacc = np.zeros((g_size, LANES), np.float32)  # probs * z_t
        for t0 in range(first, last, SPAN):
            n = min(SPAN, last - t0)
            width = (n + LANES - 1) // LANES * LANES
            gather_words(codes, b, t0, n, w0, nw, wb, SPAN)
            for t in range(n):
                sbuf[t] = f16(scale_zero[t0 + t, b, 0])
                zbuf[t] = f16(scale_zero[t0 + t, b, 1])
            sbuf[n:width] = ZERO  # lanes past the end get probability 0, and 0 * garbage may be NaN
            zbuf[n:width] = ZERO
            for g in range(g_size):
                row = (b * hq_all + h * g_size + g) * n_tok + t0
                za = vload(zacc, g * LANES)
                for k in range(0, width, LANES):
                    p = vload_first(probs, row + k, n - k)  # zero past the span's end
                    vstore(weights, g * SPAN + k, vmul(p, vload(sbuf, k)))
                    za = vfma(p, vload(zbuf, k), za)
                vstore(zacc, g * LANES, za)
            for gt in range(0, g_size, TILE):
                _accumulate(wb, w0, h * d, d, bits, vlut, weights, gt, min(TILE, g_size - gt), width, acc)
        for g in range(g_size):
            zsum = vhsum(vload(zacc, g * LANES))
            for c in range(d):
                partial[b, h, ck, g, c] = vhsum(vload(acc, (g * d + c) * LANES)) + zsum


@njit(cache=True, inline="always")
def _accumulate(wb, w0, c0, d, bits, vlut, weights, gt, ng, width, acc):
    """acc[gt + i, c, :] += weights[gt + i] * level[code of channel c0 + c] over the span, i < ng <= 4."""
    for c in range(d):
        a0 = vload(acc, (gt * d + c) * LANES)
        a1 = vload(acc, ((gt + 1) * d + c) * LANES) if ng > 1 else a0
        a2 = vload(acc, ((gt + 2) * d + c) * LANES) if ng > 2 else a0
        a3 = vload(acc, ((gt + 3) * d + c) * LANES) if ng > 3 else a0
        for k in range(0, width, LANES):
            v = decode(wb, SPAN, w0, c0 + c, bits, vlut, 0, k)
            a0 = vfma(vload(weights, gt * SPAN + k), v, a0)
            if ng > 1:
                a1 = vfma(vload(weights, (gt + 1) * SPAN + k), v, a1)
            if ng > 2:
                a2 = vfma(vload(weights, (gt + 2) * SPAN + k), v, a2)
            if ng > 3:
                a3 = vfma(vload(weights, (gt + 3) * SPAN + k), v, a3)
        vstore(acc, (gt * d + c) * LANES, a0)
        if ng > 1:
            vstore(acc, ((gt + 1) * d + c) * LANES, a1)
        if ng > 2:
            vstore(acc, ((gt + 2) * d + c) * LANES, a2)
        if ng > 3:
            vstore(acc, ((gt + 3) * d + c) * LANES, a3)


@njit(cache=True, inline="always")
def _dense_value(codes, t, b, c, bits, vlut, scale_zero):
    s = f16(scale_zero[t, b, 0])
    z = f16(scale_zero[t, b, 1])
    return vlut[0, code_at(codes, t, b, c, bits)] * s + z


@njit(cache=True)
def sink_values(probs, codes, vlut, bits, heads, scale_zero, pointers, channels, values, sink_v, sink_slot,
                 out):
    """out += probs * (exact - stored) over every channel of every sink, where stored is what the value pass
    and the outlier pass summed for that slot (its dequantized element or an outlier stored there)."""
    n_rows = codes.shape[1]
    hq_all, d = out.shape[1], out.shape[2]
    g_size = hq_all // heads
    for b in range(sink_slot.shape[0]):
        for s in range(sink_slot.shape[1]):
            t = sink_slot[b, s]
            if t < 0:
                continue
            e, e_end = 0, 0
            if pointers.shape[0] > 0:
                e, e_end = pointers[t * n_rows + b], pointers[t * n_rows + b + 1]
            for c in range(heads * d):
                h, j = c // d, c % d
                if e < e_end and np.int64(channels[e]) == c:  # entries of a slot are in channel order
                    stored = f16(values[e])
                    e += 1
                else:
                    stored = _dense_value(codes, t, b, c, bits, vlut, scale_zero)
                delta = f16(sink_v[b, s, c]) - stored
                for g in range(g_size):
                    out[b, h * g_size + g, j] += probs[b, h * g_size + g, t] * delta
