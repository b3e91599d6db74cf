"""The sparse passes of the numba decode kernel: key outliers (CSC) and value outliers (CSR), load-balanced.

Work split: the slots (tokens of a row, slot n = t * B + b) are cut into
`parts` contiguous ranges holding equal numbers of non-zeros (`sparse_parts`),
so a worker's share is counted in outliers, not in tokens, and no slot is split
between two workers. Within a range, 16 consecutive slots go into the 16 lanes
and their outliers are walked together (round r takes each slot's r-th
outlier); lanes are distinct slots, so their writes never collide.

Replacement semantics, as the store reconstructs a cache: an outlier replaces
its dequantized element, so it contributes (exact - dequantized):
scores get scaling * q . RoPE(delta e_c) (RoPE is linear; the pair partner of
channel j picks up +-delta sin), outputs get p_t * delta.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .rope import BLOCK
from .simd import LANES, vadd, vload, vlookup, vmul, vsplat, vsub
from .simd_index import (
    fselect,
    gather,
    iadd,
    iand,
    igather16,
    ihmax,
    ilanes,
    ilt,
    imul,
    ior,
    iselect,
    ishl,
    ishr,
    isub,
    scatter,
)


@njit(cache=True)
def sparse_parts(pointers, parts):
    """Slot boundaries [parts + 1] of ranges with equal numbers of non-zeros (pointers: [slots + 1])."""
    slots = pointers.shape[0] - 1
    nnz = pointers[slots]
    out = np.empty(parts + 1, np.int64)
    out[0], out[parts] = 0, slots
    for i in range(1, parts):
        goal, lo, hi = nnz * i // parts, out[i - 1], slots
        while lo < hi:  # first slot starting at or after the goal
            mid = (lo + hi) // 2
            if pointers[mid] < goal:
                lo = mid + 1
            else:
                hi = mid
        out[i] = lo
    return out


@njit(cache=True, inline="always")
def _lanes(pointers, s0, s_end, n_rows, tb):
    """Per lane (slot s0 + lane): slot, mask of real slots, first outlier, count, token and row (via tb [2, 16])."""
    valid = ilt(ilanes(0), s_end - s0)
    slot = ilanes(s0)
    start = gather(pointers, slot, valid)
    count = isub(gather(pointers, iadd(slot, 1), valid), start)
    t, b = s0 // n_rows, s0 % n_rows
    for lane in range(LANES):
        tb[0, lane], tb[1, lane] = t, b
        b += 1
        if b == n_rows:
            b, t = 0, t + 1
    return slot, valid, start, count, vload(tb, 0), vload(tb, LANES)


@njit(cache=True, inline="always")
def _codes(codes_flat, n_words, slot, c, bits, act):
    """The code of channel c of each lane's slot (uint32 lanes)."""
    off = imul(c, bits)
    sh = iand(off, 31)
    word = iadd(imul(slot, n_words), ishr(off, 5))
    lo = gather(codes_flat, word, act)
    hi = gather(codes_flat, iadd(word, 1), iand(act, ilt(32 - bits, sh)))  # straddling codes only
    return iand(ior(ishr(lo, sh), ishl(hi, iand(isub(32, sh), 31))), (1 << bits) - 1)


@njit(parallel=True, cache=True)
def key_outliers(q, codes, klut, bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling,
                 pointers, channels, values, chan_head, chan_pos, parts, scores):
    """scores[b, hq, t] += scaling * q[b, hq] . RoPE(exact - dequantized) for every key outlier.

    q float32 [B, Hq, D]; codes uint32 [T, B, W]; klut float32 [C, 16]; positions uint32 [T, B];
    pointers uint32 [T*B + 1]; channels uint16 [nnz]; values fp16 bits, uint16 [nnz];
    chan_head, chan_pos uint32 [C]: head and offset of each channel; scores [B, Hq, T].
    """
    n_tok, n_rows, n_words = codes.shape
    hq_all, d = q.shape[1], q.shape[2]
    g_size, half = hq_all // heads, d // 2
    bounds = sparse_parts(pointers, parts)
    codes_flat, lut, q_flat, out = codes.reshape(-1), klut.reshape(-1), q.reshape(-1), scores.reshape(-1)
    pos_flat = positions.reshape(-1)
    chi, shi, clo, slo = cos_hi.reshape(-1), sin_hi.reshape(-1), cos_lo.reshape(-1), sin_lo.reshape(-1)
    vscale, zero = vsplat(scaling), vsplat(np.float32(0.0))
    for part in prange(parts):
        tb = np.empty((2, LANES), np.uint32)
        for s0 in range(bounds[part], bounds[part + 1], LANES):
            slot, valid, start, count, t, b = _lanes(pointers, s0, bounds[part + 1], n_rows, tb)
            pos = gather(pos_flat, slot, valid)
            hi_row, lo_col = imul(ishr(pos, 6), half), iand(pos, BLOCK - 1)
            for r in range(ihmax(count)):
                act = ilt(r, count)
                e = iadd(start, r)
                c = igather16(channels, e, act)
                h, j = gather(chan_head, c, act), gather(chan_pos, c, act)
                dense = gather(lut, iadd(imul(c, LANES), _codes(codes_flat, n_words, slot, c, bits, act)), act)
                delta = fselect(act, vsub(gather(values, e, act), dense), zero)
                low = ilt(j, half)
                pair = isub(j, iand(iselect(low, 0, 0xFFFFFFFF), half))
                partner = iadd(pair, iand(low, half))
                ch, sh = gather(chi, iadd(hi_row, pair), act), gather(shi, iadd(hi_row, pair), act)
                cl = gather(clo, iadd(imul(pair, BLOCK), lo_col), act)
                sl = gather(slo, iadd(imul(pair, BLOCK), lo_col), act)
                cos, sin = vsub(vmul(ch, cl), vmul(sh, sl)), vadd(vmul(sh, cl), vmul(ch, sl))
                direct = vmul(delta, cos)
                rot = fselect(low, vmul(delta, sin), vsub(zero, vmul(delta, sin)))
                for g in range(g_size):
                    row = iadd(imul(b, hq_all), iadd(imul(h, g_size), g))  # b * Hq + hq
                    q1 = gather(q_flat, iadd(imul(row, d), j), act)
                    q2 = gather(q_flat, iadd(imul(row, d), partner), act)
                    dst = iadd(imul(row, n_tok), t)
                    term = vmul(vadd(vmul(q1, direct), vmul(q2, rot)), vscale)
                    scatter(out, dst, vadd(gather(out, dst, act), term), act)


@njit(parallel=True, cache=True)
def value_outliers(probs, codes, vlut, bits, heads, scale_zero, pointers, channels, values, chan_head, chan_pos,
                   partial):
    """partial[part, b, hq, :] += probs[b, hq, t] * (exact - dequantized) over the value outliers of part's slots.

    probs float32 [B, Hq, T]; codes uint32 [T, B, W]; vlut float32 [1, 16]; scale_zero fp16 bits [T, B, 2];
    pointers uint32 [T*B + 1]; channels uint16; values fp16 bits; chan_head, chan_pos: as `key_outliers`;
    partial float32 [parts, B, Hq, D].
    Lanes keep private sums ([16, B, Hq, D] per part), since two slots may hit the same (hq, channel).
    """
    n_tok, n_rows, n_words = codes.shape
    parts, _, hq_all, d = partial.shape
    g_size = hq_all // heads
    bounds = sparse_parts(pointers, parts)
    codes_flat, p_flat, sz_flat = codes.reshape(-1), probs.reshape(-1), scale_zero.reshape(-1)
    levels = vload(vlut, 0)
    zero = vsplat(np.float32(0.0))
    per_lane = n_rows * hq_all * d
    for part in prange(parts):
        tb = np.empty((2, LANES), np.uint32)
        acc = np.zeros(LANES * per_lane, np.float32)
        lane_base = imul(ilanes(0), per_lane)
        for s0 in range(bounds[part], bounds[part + 1], LANES):
            slot, valid, start, count, t, b = _lanes(pointers, s0, bounds[part + 1], n_rows, tb)
            s = gather(sz_flat, imul(slot, 2), valid)
            z = gather(sz_flat, iadd(imul(slot, 2), 1), valid)
            for r in range(ihmax(count)):
                act = ilt(r, count)
                e = iadd(start, r)
                c = igather16(channels, e, act)
                h, j = gather(chan_head, c, act), gather(chan_pos, c, act)
                dense = vadd(vmul(vlookup(levels, _codes(codes_flat, n_words, slot, c, bits, act)), s), z)
                delta = fselect(act, vsub(gather(values, e, act), dense), zero)
                for g in range(g_size):
                    row = iadd(imul(b, hq_all), iadd(imul(h, g_size), g))  # b * Hq + hq
                    p = gather(p_flat, iadd(imul(row, n_tok), t), act)
                    dst = iadd(lane_base, iadd(imul(row, d), j))
                    scatter(acc, dst, vadd(gather(acc, dst, act), vmul(p, delta)), act)
        flat = partial[part].reshape(-1)
        for lane in range(LANES):
            for i in range(per_lane):
                flat[i] += acc[lane * per_lane + i]
