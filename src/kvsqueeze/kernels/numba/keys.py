"""Key side of the numba decode kernel: scores over packed keys, sinks, softmax (outliers: `sparse.py`).

See `attend.py` for the order of the passes and `common.py` for the layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import K_CODES, ZERO, block_rotation, decode, gather_words, head_words, max_head_words
from .tables import BLOCK
from .simd import (
    LANES,
    f16,
    ulanes,
    vadd,
    vfma,
    vfms,
    vgather,
    vhalf,
    vhmax,
    vhsum,
    vindex16,
    vload,
    vload_first,
    vmax,
    vmul,
    vsplat,
    vstore,
    vstore_first,
    vsub,
)

KEY_TILE = 3  # query heads per pass over a block: 3 x 4 accumulator vectors in registers
if BLOCK != 4 * LANES:  # `_dot_group` covers a block with four vectors
    raise ImportError(f"keys.py assumes a block of {4 * LANES} tokens, got {BLOCK}")


@njit(parallel=True, cache=True)
def key_scores(q, codes, rows, geo, shift, klut, bits, offs, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling,
               starts, scores):
    """scores[b, hq, t] = scaling * q[b, hq] . RoPE(LUT-dequantized key of token t, KV head hq // G).

    RoPE turns the first R = 2 * len(inv_freq) channels of a head in pairs (j, j + R/2) (the tables' width:
    R = D unless the model rotates part of each head) and leaves the others as they are.

    Args:
        q: float32 [B, Hq, D]; codes: uint32, flat; rows uint32 [B, >= T], geo int64 [7, 3], shift: where each
            token's codes lie (`common.at`); klut: float32 [C, R] per-channel tables (R = 16, or 64 for 5- and 6-bit channels).
        bits: every channel's code width (0: channels have their own); offs: int32 [C + 1], each channel's
            first stream bit (`common.py`).
        positions: int32 [T, B]; cos_hi .. sin_lo: `rope.RopeTables`.
        starts: int64 [items + 1], the token ranges of the work items of every row.
        scores: float32 [B, Hq, T], written.
    """
    n_rows, n_tok = scores.shape[0], scores.shape[2]
    hq_all, d = q.shape[1], q.shape[2]
    g_size = hq_all // heads
    rot = cos_lo.shape[0]  # rotary pairs
    n_items = starts.shape[0] - 1
    max_words = max_head_words(offs, heads, d)
    vscale = vsplat(scaling)
    for item in prange(n_rows * n_items):
        b = item // n_items
        first, last = starts[item % n_items], starts[item % n_items + 1]
        wb = np.empty((max_words, BLOCK), np.uint32)
        cs = np.empty((rot, BLOCK), np.float32)
        sn = np.empty((rot, BLOCK), np.float32)
        qr = np.empty((1, hq_all, d), np.float32)
        for t0 in range(first, last, BLOCK):
            n = min(BLOCK, last - t0)
            if block_rotation(q, b, positions, t0, n, cos_hi, sin_hi, cos_lo, sin_lo, qr, cs, sn):
                qs, qb, ct, st = qr, 0, cos_lo, sin_lo  # queries turned back by the block's first position
            else:
                qs, qb, ct, st = q, b, cs, sn  # tables at each token's position
            for h in range(heads):
                w0, nw = head_words(offs, h, d)
                gather_words(codes, rows, geo, K_CODES, shift, b, t0, n, w0, nw, wb, BLOCK)
                for gt in range(0, g_size, KEY_TILE):
                    _dot_group(qs, qb, h * g_size + gt, min(KEY_TILE, g_size - gt), wb, w0, h * d, rot, d, bits,
                               offs, klut, ct, st, n, vscale, scores, ((b * hq_all) + h * g_size + gt) * n_tok + t0,
                               n_tok)


@njit(cache=True, inline="always")
def _rot(x, y, c, s):
    return vfms(x, c, vmul(y, s)), vfma(y, c, vmul(x, s))


@njit(cache=True, inline="always")
def _dot_group(q, b, qh, ng, wb, w0, c0, half, d, bits, offs, klut, cs, sn, n, vscale, scores, base, n_tok):
    """Scores of query heads qh..qh+ng (ng <= 3) for one block: 64 tokens (four vectors) per pass over the pairs.

    The 12 accumulators stay in registers; each rotary pair (j, j + half) of the head's channels is decoded,
    rotated and multiplied into every query head of the tile, so a query element is broadcast once per 64
    tokens; channels past 2 * half (partial rotary) are decoded and multiplied as they are.
    """
    for k in range(0, n, 4 * LANES):
        a0 = a1 = a2 = a3 = e0 = e1 = e2 = e3 = f0 = f1 = f2 = f3 = vsplat(ZERO)
        for j in range(2 * half, d):  # channels RoPE leaves alone
            x0 = decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k)
            x1 = decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + LANES)
            x2 = decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + 2 * LANES)
            x3 = decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + 3 * LANES)
            qx = vsplat(q[b, qh, j])
            a0, a1, a2, a3 = vfma(qx, x0, a0), vfma(qx, x1, a1), vfma(qx, x2, a2), vfma(qx, x3, a3)
            if ng > 1:
                qx = vsplat(q[b, qh + 1, j])
                e0, e1, e2, e3 = vfma(qx, x0, e0), vfma(qx, x1, e1), vfma(qx, x2, e2), vfma(qx, x3, e3)
            if ng > 2:
                qx = vsplat(q[b, qh + 2, j])
                f0, f1, f2, f3 = vfma(qx, x0, f0), vfma(qx, x1, f1), vfma(qx, x2, f2), vfma(qx, x3, f3)
        for j in range(half):
            xr0, yr0 = _rot(decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k),
                            decode(wb, BLOCK, w0, offs, c0 + j + half, bits, klut, k),
                            vload(cs, j * BLOCK + k), vload(sn, j * BLOCK + k))
            xr1, yr1 = _rot(decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + LANES),
                            decode(wb, BLOCK, w0, offs, c0 + j + half, bits, klut, k + LANES),
                            vload(cs, j * BLOCK + k + LANES), vload(sn, j * BLOCK + k + LANES))
            xr2, yr2 = _rot(decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + 2 * LANES),
                            decode(wb, BLOCK, w0, offs, c0 + j + half, bits, klut, k + 2 * LANES),
                            vload(cs, j * BLOCK + k + 2 * LANES), vload(sn, j * BLOCK + k + 2 * LANES))
            xr3, yr3 = _rot(decode(wb, BLOCK, w0, offs, c0 + j, bits, klut, k + 3 * LANES),
                            decode(wb, BLOCK, w0, offs, c0 + j + half, bits, klut, k + 3 * LANES),
                            vload(cs, j * BLOCK + k + 3 * LANES), vload(sn, j * BLOCK + k + 3 * LANES))
            qx, qy = vsplat(q[b, qh, j]), vsplat(q[b, qh, j + half])
            a0 = vfma(qy, yr0, vfma(qx, xr0, a0))
            a1 = vfma(qy, yr1, vfma(qx, xr1, a1))
            a2 = vfma(qy, yr2, vfma(qx, xr2, a2))
            a3 = vfma(qy, yr3, vfma(qx, xr3, a3))
            if ng > 1:
                qx, qy = vsplat(q[b, qh + 1, j]), vsplat(q[b, qh + 1, j + half])
                e0 = vfma(qy, yr0, vfma(qx, xr0, e0))
                e1 = vfma(qy, yr1, vfma(qx, xr1, e1))
                e2 = vfma(qy, yr2, vfma(qx, xr2, e2))
                e3 = vfma(qy, yr3, vfma(qx, xr3, e3))
            if ng > 2:
                qx, qy = vsplat(q[b, qh + 2, j]), vsplat(q[b, qh + 2, j + half])
                f0 = vfma(qy, yr0, vfma(qx, xr0, f0))
                f1 = vfma(qy, yr1, vfma(qx, xr1, f1))
                f2 = vfma(qy, yr2, vfma(qx, xr2, f2))
                f3 = vfma(qy, yr3, vfma(qx, xr3, f3))
        for g, (v0, v1, v2, v3) in enumerate(((a0, a1, a2, a3), (e0, e1, e2, e3), (f0, f1, f2, f3))):
            if g < ng:
                o = base + g * n_tok + k
                vstore_first(scores, o, vmul(v0, vscale), n - k)
                vstore_first(scores, o + LANES, vmul(v1, vscale), n - k - LANES)
                vstore_first(scores, o + 2 * LANES, vmul(v2, vscale), n - k - 2 * LANES)
                vstore_first(scores, o + 3 * LANES, vmul(v3, vscale), n - k - 3 * LANES)


@njit(parallel=True, cache=True)
def sink_scores(q, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, sink_k, sink_slot, scores):
    """Overwrite the scores of sink tokens with those of their exact keys (fp16 bits, uint16 [B, S, C], pre-RoPE):
    the attention sinks and a method's fp16 window.

    One work item per (row, entry), 16 rotary pairs at a time in vector lanes: the cos and sin of the entry's
    position are formed once for every KV head (as `block_rotation` forms them), each head's pairs are turned and
    multiplied into every query head of its group, each query head summing its lanes at the end. Channels past
    the rotary ones (partial rotary) are added one by one."""
    hq_all, d = q.shape[1], q.shape[2]
    g_size = hq_all // heads
    half = cos_lo.shape[0]  # rotary pairs (j, j + half); channels from 2 * half on are not turned
    n_s, c_all = sink_slot.shape[1], sink_k.shape[2]
    for i in prange(sink_slot.shape[0] * n_s):
        b, s = i // n_s, i % n_s
        t = sink_slot[b, s]
        if t < 0:
            continue
        p = positions[t, b]
        hi = p // BLOCK
        lo = p - hi * BLOCK
        entry = (b * n_s + s) * c_all
        acc = np.zeros((hq_all, LANES), np.float32)
        for j in range(0, half, LANES):
            m = min(LANES, half - j)
            ch, sh = vload_first(cos_hi, hi * half + j, m), vload_first(sin_hi, hi * half + j, m)
            cl, sl = vgather(cos_lo, j * BLOCK + lo, BLOCK, m), vgather(sin_lo, j * BLOCK + lo, BLOCK, m)
            cos, sin = vsub(vmul(ch, cl), vmul(sh, sl)), vadd(vmul(sh, cl), vmul(ch, sl))
            for h in range(heads):
                x = vhalf(vindex16(sink_k, entry + h * d + j, ulanes(), m))
                y = vhalf(vindex16(sink_k, entry + h * d + j + half, ulanes(), m))
                kx, ky = vsub(vmul(x, cos), vmul(y, sin)), vadd(vmul(y, cos), vmul(x, sin))
                for r in range(h * g_size, (h + 1) * g_size):
                    qo = (b * hq_all + r) * d
                    a = vfma(vload_first(q, qo + j, m), kx, vload(acc, r * LANES))
                    vstore(acc, r * LANES, vfma(vload_first(q, qo + half + j, m), ky, a))
        for r in range(hq_all):
            total = vhsum(vload(acc, r * LANES))
            base = (r // g_size) * d
            for j in range(2 * half, d):
                total += q[b, r, j] * f16(sink_k[b, s, base + j])
            scores[b, r, t] = total * scaling


@njit(parallel=True, cache=True)
def row_max(scores, bias, softcap, m):
    """m[b, hq] = max over T of scores[b, hq] + bias[b], the bias added in place (bias float32 [B, T] of
    0 / -inf, or [0, 0]: none), after soft-capping the scores to softcap * tanh(score / softcap) where
    softcap > 0 (Gemma-2). The softmax itself happens in the value pass: exp(score - m) there."""
    n_rows, hq_all, n_tok = scores.shape
    full = n_tok // LANES * LANES
    for r in prange(n_rows * hq_all):
        row = r * n_tok
        flat = scores.reshape(-1)
        if softcap > 0:
            for t in range(n_tok):
                flat[row + t] = softcap * np.tanh(flat[row + t] / softcap)
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
