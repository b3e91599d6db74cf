"""Value side of the numba decode kernel: weights times packed values, sinks (outliers: `sparse.py`).

See `attend.py` for the order of the passes and `common.py` for the layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import (SCALE_ZERO, SPAN, TILE, V_CHANNELS, V_CODES, V_VALUES, ZERO, at, decode, gather_words,
                     head_words, max_head_words)
from .simd import (
    LANES,
    f16,
    uadd,
    ulanes,
    umin,
    umul,
    uand,
    ushr,
    vadd,
    vexp,
    vfma,
    vfunnel,
    vhalf,
    vhsum,
    vindex,
    vindex16,
    vload,
    vload_first,
    vmul,
    vsplat,
    vstore,
    vstore_first,
    vsub,
)

ONE = np.float32(1.0)


# ---- values ------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def value_sums(scores, m, codes, rows, geo, shift, vlut, bits, offs, heads, scale_zero, sz, starts, partial, psum):
    """partial[b, h, item, g, :] = sum over the item's tokens of p_t * dequantized value, values read packed,
    with the unnormalized softmax weights p_t = exp(score_t - m[b, hq]); psum[b, h, item, g] = sum of p_t.

    A work item is a range of tokens of one row, all KV heads: the span's words are read from memory for
    the first head and are still in cache for the others (a token's codes for every head share its cache
    lines). The exponentials are taken here, span by span, and written back over the scores for the sparse
    and sink passes; the caller divides by the total of psum at the end. A value is level[code] * s_t + z_t;
    sum_t p_t v_t is accumulated as sum_t (p_t s_t) level[code] + sum_t p_t z_t.

    Args:
        scores: float32 [B, Hq, T], scaled and masked (-inf) scores; read, then overwritten with p_t.
        m: float32 [B, Hq], the row maxima; codes (uint32, flat), rows, geo, shift: as `keys.key_scores`;
            vlut: float32 [C, R] (each channel's levels, repeated); bits, offs: as `keys.key_scores`.
        scale_zero: fp16 bits, uint16, flat, the per-token scales and zero-points; sz: float32 [2, B, T],
            written: the same in float32 and planar (contiguous over tokens), each item converting its own
            tokens once for all KV heads (the value outlier pass reads them after); starts: int64 [items + 1],
            the token ranges of the work items.
        partial: float32 [B, H, items, G, D], psum: float32 [B, H, items, G], written.
    """
    probs = scores
    n_rows, n_tok = scores.shape[0], scores.shape[2]
    hq_all = probs.shape[1]
    g_size = hq_all // heads
    d, n_items = partial.shape[4], partial.shape[2]
    max_words = max_head_words(offs, heads, d)
    for item in prange(n_rows * n_items):
        b, ck = item // n_items, item % n_items
        first, last = starts[ck], starts[ck + 1]
        s_row, z_row = b * n_tok, (n_rows + b) * n_tok  # flat offsets of sz[0, b, 0] and sz[1, b, 0]
        wb = np.empty((max_words, SPAN), np.uint32)
        weights = np.empty((g_size, SPAN), np.float32)  # probs * s_t
        acc = np.empty((heads, g_size, d, LANES), np.float32)  # written by the first span, added to after
        zacc = np.zeros((heads, g_size, LANES), np.float32)  # p_t * z_t
        tacc = np.zeros((heads, g_size, LANES), np.float32)  # p_t
        live = np.empty(SPAN, np.float32)  # 1 for the span's tokens, 0 past its end
        for t0 in range(first, last, SPAN):
            n = min(SPAN, last - t0)
            width = (n + LANES - 1) // LANES * LANES
            live[:n] = ONE  # lanes past the end get weight 0 (vload_first reads their scales as 0 too)
            live[n:width] = ZERO
            for t in range(t0, t0 + n):
                e = at(rows[b, t], geo, SCALE_ZERO, shift)
                sz[0, b, t] = f16(scale_zero[e])
                sz[1, b, t] = f16(scale_zero[e + 1])
            for h in range(heads):
                w0, nw = head_words(offs, h, d)
                gather_words(codes, rows, geo, V_CODES, shift, b, t0, n, w0, nw, wb, SPAN)
                for g in range(g_size):
                    row = (b * hq_all + h * g_size + g) * n_tok + t0
                    mv = vsplat(m[b, h * g_size + g])
                    za, ta = vload(zacc, (h * g_size + g) * LANES), vload(tacc, (h * g_size + g) * LANES)
                    for k in range(0, width, LANES):
                        p = vmul(vexp(vsub(vload_first(probs, row + k, n - k), mv)), vload(live, k))
                        vstore_first(probs, row + k, p, n - k)
                        vstore(weights, g * SPAN + k, vmul(p, vload_first(sz, s_row + t0 + k, n - k)))
                        za = vfma(p, vload_first(sz, z_row + t0 + k, n - k), za)
                        ta = vadd(ta, p)
                    vstore(zacc, (h * g_size + g) * LANES, za)
                    vstore(tacc, (h * g_size + g) * LANES, ta)
                for gt in range(0, g_size, TILE):
                    _accumulate(wb, w0, h * d, d, bits, offs, vlut, weights, gt, min(TILE, g_size - gt), width, acc[h],
                                t0 == first)
        for h in range(heads):
            for g in range(g_size):
                psum[b, h, ck, g] = vhsum(vload(tacc, (h * g_size + g) * LANES))
                zsum = vhsum(vload(zacc, (h * g_size + g) * LANES))
                for c in range(d):
                    partial[b, h, ck, g, c] = vhsum(vload(acc, ((h * g_size + g) * d + c) * LANES)) + zsum


@njit(cache=True, inline="always")
def _accumulate(wb, w0, c0, d, bits, offs, vlut, weights, gt, ng, width, acc, fresh):
    """acc[gt + i, c, :] += weights[gt + i] * level[code of channel c0 + c] over the span, i < ng <= 4 (`fresh`:
    acc holds nothing yet, the sums are stored over it).

    Two channels per pass (d is even): each weight vector is loaded once for both, and the 2 * ng
    accumulators are independent chains, so the loop is not bound by the latency of one chain of FMAs.
    """
    for c in range(0, d, 2):
        i0, i1 = (gt * d + c) * LANES, (gt * d + c + 1) * LANES
        if fresh:  # the item's first span: the accumulators start at zero (acc is not cleared beforehand)
            a0 = e0 = a1 = e1 = a2 = e2 = a3 = e3 = vsplat(ZERO)
        else:
            a0, e0 = vload(acc, i0), vload(acc, i1)
            a1, e1 = (vload(acc, i0 + d * LANES), vload(acc, i1 + d * LANES)) if ng > 1 else (a0, e0)
            a2, e2 = (vload(acc, i0 + 2 * d * LANES), vload(acc, i1 + 2 * d * LANES)) if ng > 2 else (a0, e0)
            a3, e3 = (vload(acc, i0 + 3 * d * LANES), vload(acc, i1 + 3 * d * LANES)) if ng > 3 else (a0, e0)
        for k in range(0, width, LANES):
            v = decode(wb, SPAN, w0, offs, c0 + c, bits, vlut, k)
            u = decode(wb, SPAN, w0, offs, c0 + c + 1, bits, vlut, k)
            w = vload(weights, gt * SPAN + k)
            a0, e0 = vfma(w, v, a0), vfma(w, u, e0)
            if ng > 1:
                w = vload(weights, (gt + 1) * SPAN + k)
                a1, e1 = vfma(w, v, a1), vfma(w, u, e1)
            if ng > 2:
                w = vload(weights, (gt + 2) * SPAN + k)
                a2, e2 = vfma(w, v, a2), vfma(w, u, e2)
            if ng > 3:
                w = vload(weights, (gt + 3) * SPAN + k)
                a3, e3 = vfma(w, v, a3), vfma(w, u, e3)
        vstore(acc, i0, a0)
        vstore(acc, i1, e0)
        if ng > 1:
            vstore(acc, i0 + d * LANES, a1)
            vstore(acc, i1 + d * LANES, e1)
        if ng > 2:
            vstore(acc, i0 + 2 * d * LANES, a2)
            vstore(acc, i1 + 2 * d * LANES, e2)
        if ng > 3:
            vstore(acc, i0 + 3 * d * LANES, a3)
            vstore(acc, i1 + 3 * d * LANES, e3)


@njit(parallel=True, cache=True)
def sink_values(probs, codes, rows, geo, shift, vlut, offs, heads, scale_zero, pointers, fixed, channels, values,
                sink_v, sink_slot, out):
    """out += probs * (exact - stored) over every channel of every sink, where stored is what the value pass
    and the outlier pass summed for that slot (its dequantized element or an outlier stored there).
    codes, rows, geo, shift, scale_zero: as `value_sums`. fixed > 0: every slot holds that many outliers, where
    `geo` puts them (`pointers` is not read); else pointers [T*B + 1] by slot (a store's token-major arrays) or
    empty. One work item per (row, KV head), which alone writes its query heads' outputs, sinks in order.

    16 channels of the head at a time in vector lanes: each lane gathers its code's word and the next (a code may
    straddle them; the next is never past the slot's last word), funnel-shifts the code down and reads its level
    from its channel's table row, whose entries repeat with the code's period, so the bits above the code select
    the same level. An outlier stored in the slot replaces its lane's element before the products are added."""
    n_rows = rows.shape[0]
    hq_all, d = out.shape[1], out.shape[2]
    g_size = hq_all // heads
    row = vlut.shape[1]  # 16, or 64 with 5- and 6-bit channels: a power of two
    n_s, c_all = sink_slot.shape[1], sink_v.shape[2]
    last = (offs[offs.shape[0] - 1] - 1) >> 5  # a slot's last code word
    for i in prange(sink_slot.shape[0] * heads):
        b, h = i // heads, i % heads
        lane_offs = np.empty(-(-d // LANES) * LANES, np.uint32)  # the head's channels' first bits, by lane
        for k in range(lane_offs.shape[0]):  # lanes past the head's channels repeat its first (addresses in range)
            lane_offs[k] = offs[h * d + k] if k < d else offs[h * d]
        delta = np.empty(LANES, np.float32)
        for s in range(n_s):
            t = sink_slot[b, s]
            if t < 0:
                continue
            e, e_end, to_value = 0, 0, 0
            slot = rows[b, t]
            if fixed > 0:
                e = at(slot, geo, V_CHANNELS, shift)
                e_end, to_value = e + fixed, at(slot, geo, V_VALUES, shift) - e
            elif pointers.shape[0] > 0:
                e, e_end = pointers[t * n_rows + b], pointers[t * n_rows + b + 1]
            first, e_sz = at(slot, geo, V_CODES, shift), at(slot, geo, SCALE_ZERO, shift)
            scale, zero = vsplat(f16(scale_zero[e_sz])), vsplat(f16(scale_zero[e_sz + 1]))
            for j in range(0, d, LANES):
                m = min(LANES, d - j)
                c0 = h * d + j
                off = vload(lane_offs, j)
                word = ushr(off, 5)
                code = vfunnel(vindex(codes, first, word, m), vindex(codes, first, umin(uadd(word, 1), last), m),
                               uand(off, 31))
                level = vindex(vlut, c0 * row, uadd(umul(ulanes(), row), uand(code, row - 1)), m)
                exact = vhalf(vindex16(sink_v, (b * n_s + s) * c_all + c0, ulanes(), m))
                vstore(delta, 0, vsub(exact, vadd(vmul(level, scale), zero)))
                while e < e_end and np.int64(channels[e]) < c0 + m:  # entries of a slot are in channel order
                    c = np.int64(channels[e])
                    if c >= c0:
                        delta[c - c0] = f16(sink_v[b, s, c]) - f16(values[e + to_value])
                    e += 1
                dv = vload(delta, 0)
                for r in range(h * g_size, (h + 1) * g_size):
                    o = (b * hq_all + r) * d + j
                    vstore_first(out, o, vadd(vload_first(out, o, m), vmul(vsplat(probs[b, r, t]), dv)), m)
