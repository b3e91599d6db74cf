"""The sparse passes of the numba decode kernel: key outliers (CSC) and value outliers (CSR), load-balanced.

Work split: the slots (tokens of a row, slot n = t * B + b) are cut into
`parts` contiguous ranges holding equal numbers of non-zeros (`sparse_parts`),
so a worker's share is counted in outliers, not in tokens, and no slot is split
between two workers. Within a range, slots and their outliers are walked in
order (key outliers in one flat loop over the entries, see `key_outliers`),
one outlier at a time in scalar code: key outlier counts differ from slot to
slot, and two outliers of one slot and head add into the same scores.

Value outliers as the cache keeps them have the same count k in every slot
(`Outliers.fixed`): equal token ranges then hold equal numbers of non-zeros,
and `value_outliers_fixed` takes 16 slots at a time, the i-th outlier of each
in one vector lane, with one accumulator copy per lane so that no two lanes
ever add into the same element.

Replacement semantics, as the store reconstructs a cache: an outlier replaces
its dequantized element, so it contributes (exact - dequantized):
scores get scaling * q . RoPE(delta e_c) (RoPE is linear; the pair partner of
channel j picks up +-delta sin), outputs get p_t * delta.

The store keeps one known code under every outlier (`Outliers.code`), so the
dequantized element comes from the channel's table (keys) or the slot's scale
(values) alone: the sparse passes then never touch the packed codes, which
would otherwise be read a second time, slot after slot, from memory. Without
that promise they read each outlier's code from the packed words.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import V_CHANNELS, V_CODES, V_VALUES, vat
from .tables import BLOCK
from .simd import (
    LANES,
    f16,
    uadd,
    uand,
    ulanes,
    umin,
    umul,
    ushr,
    vadd,
    vbelow,
    vfunnel,
    vhalf,
    vindex,
    vindex16,
    vload,
    vload_first,
    vlookup,
    vmul,
    vscatter,
    vsplat,
    vsub,
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


U = np.uint64  # inner-loop indices are unsigned: numba adds no negative-index wraparound to their loads


@njit(cache=True, inline="always")
def _code(codes_flat, first, c, bits):
    """The code of channel c of the slot whose words start at element `first`, branch-free: two adjacent words
    cover a straddling code (uint64)."""
    off = c * bits
    w = first + (off >> U(5))
    hi = codes_flat[min(w + U(1), U(codes_flat.shape[0] - 1))]  # clipped index: only read when a code straddles
    pair = U(codes_flat[w]) | (U(hi) << U(32))
    return (pair >> (off & U(31))) & ((U(1) << bits) - U(1))


@njit(cache=True, inline="always")
def _steps(slot0, n_rows):
    """Token and row of the slot before slot0, the row modulo 2**64 (the loops step them: no division per slot)."""
    return U(slot0 // n_rows), U(slot0 % n_rows) - U(1)


@njit(parallel=True, cache=True)
def key_outliers(q, codes, slot_words, klut, bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling,
                 pointers, entry_base, to_value, channels, values, code_under, chan_head, chan_pos, parts, scores):
    """scores[b, hq, t] += scaling * q[b, hq] . RoPE(exact - dequantized) for every key outlier.

    q float32 [B, Hq, D]; codes uint32, flat, slot n's words from element slot_words[n] (uint32 [T*B]); klut
    float32 [C, R]; positions uint32 [T, B]; pointers uint32 [T*B + 1]: slot n holds pointers[n + 1] -
    pointers[n] outliers, their channels from element entry_base[n] (uint32 [T*B]) of channels (uint16), their
    values `to_value` elements further on in values (fp16 bits, uint16); code_under: the code every outlier's
    element holds in `codes` (the pass then reads no codes), -1 when they vary;
    chan_head, chan_pos uint32 [C]: head and offset of each channel; scores [B, Hq, T].
    Per channel c (head h, offset j) and query head g of its group, the kernel first folds the scaling and the
    pair's sign into qt [B, C, G, 2] = scaling * (q[hq, j], +-q[hq, partner]): an outlier then costs a table
    entry (and a code, when code_under is -1), four RoPE table entries and G multiply-adds.
    """
    n_rows, n_tok = q.shape[0], scores.shape[2]
    hq_all, d = q.shape[1], q.shape[2]
    n_chan, g_size, half, width = chan_head.shape[0], hq_all // heads, cos_lo.shape[0], klut.shape[1]
    bounds = sparse_parts(pointers, parts)
    qt = np.empty((n_rows, n_chan, g_size, 2), np.float32)
    pair, c_out = np.empty(n_chan, np.uint64), np.empty(n_chan, np.uint64)  # pair of c; offset of hq = h * G in scores
    for c in range(n_chan):
        h, j = chan_head[c], chan_pos[c]
        c_out[c] = h * g_size * n_tok
        if j >= 2 * half:  # past the rotary channels (partial rotary): delta * q[j] alone, `pair` says so
            pair[c] = half
            for b in range(n_rows):
                for g in range(g_size):
                    qt[b, c, g, 0] = scaling * q[b, h * g_size + g, j]
                    qt[b, c, g, 1] = 0.0
            continue
        pair[c] = j % half
        partner, sign = (j + half, scaling) if j < half else (j - half, -scaling)
        for b in range(n_rows):
            for g in range(g_size):
                qt[b, c, g, 0] = scaling * q[b, h * g_size + g, j]
                qt[b, c, g, 1] = sign * q[b, h * g_size + g, partner]
    codes_flat, lut, qt_flat, out = codes.reshape(-1), klut.reshape(-1), qt.reshape(-1), scores.reshape(-1)
    pos_flat = positions.reshape(-1)
    chi, shi, clo, slo = cos_hi.reshape(-1), sin_hi.reshape(-1), cos_lo.reshape(-1), sin_lo.reshape(-1)
    ub, ug, ut, uwidth, uhalf, un_rows, uv = U(bits), U(g_size), U(n_tok), U(width), U(half), U(n_rows), U(to_value)
    known, ucode = code_under >= 0, U(max(code_under, 0))
    for part in prange(parts):
        s_lo, s_hi = U(bounds[part]), U(bounds[part + 1])
        e0, e1 = U(pointers[s_lo]), U(pointers[s_hi])
        # The part walks its entries in one flat loop: the slot of entry e is s_lo plus the number of the part's
        # slots that end at or before e, counted once into `ends` and summed along the walk. A loop over slots
        # with an inner loop over each slot's entries would mispredict the inner loop's exit on almost every
        # slot (key outlier counts per token are irregular), which cost a third of this pass.
        ends = np.zeros(e1 - e0 + U(1), np.uint32)
        for s in range(s_lo, s_hi):
            ends[U(pointers[s + U(1)]) - e0] += U(1)
        slot = s_lo
        for s in range(s_lo, s_hi):  # slots before the first entry hold none
            if U(pointers[s + U(1)]) > e0:
                break
            slot += U(1)
        for e in range(e0, e1):
            if e > e0:
                slot += U(ends[e - e0])
            if un_rows == U(1):
                t, b = slot, U(0)
            else:
                t, b = slot // un_rows, slot % un_rows
            p = U(pos_flat[slot])
            hi_row, lo_col = (p // U(BLOCK)) * uhalf, p % U(BLOCK)
            row_out = b * U(hq_all) * ut + t  # scores[b, 0, t]
            ea = e - U(pointers[slot]) + U(entry_base[slot])  # where the slot's entries are stored
            c = U(channels[ea])
            if c >= U(n_chan):  # NO_CHANNEL: an empty entry
                continue
            if known:
                delta = f16(values[ea + uv]) - lut[c * uwidth + ucode]
            else:
                delta = f16(values[ea + uv]) - lut[c * uwidth + _code(codes_flat, U(slot_words[slot]), c, ub)]
            pr = pair[c]
            if pr < uhalf:
                ch, sh = chi[hi_row + pr], shi[hi_row + pr]
                cl, sl = clo[pr * U(BLOCK) + lo_col], slo[pr * U(BLOCK) + lo_col]
                dc, ds = delta * (ch * cl - sh * sl), delta * (sh * cl + ch * sl)  # delta * (cos, sin)
            else:  # a channel RoPE leaves alone
                dc, ds = delta, np.float32(0.0)
            o, qi = row_out + c_out[c], (b * U(n_chan) + c) * ug * U(2)
            g = U(0)
            while g + U(2) < ug:  # three query heads at a time, loads before stores (rows T apart would alias)
                i0, k = o + g * ut, qi + U(2) * g
                a0 = out[i0] + (qt_flat[k] * dc + qt_flat[k + U(1)] * ds)
                a1 = out[i0 + ut] + (qt_flat[k + U(2)] * dc + qt_flat[k + U(3)] * ds)
                a2 = out[i0 + U(2) * ut] + (qt_flat[k + U(4)] * dc + qt_flat[k + U(5)] * ds)
                out[i0], out[i0 + ut], out[i0 + U(2) * ut] = a0, a1, a2
                g += U(3)
            while g < ug:
                out[o + g * ut] += qt_flat[qi + U(2) * g] * dc + qt_flat[qi + U(2) * g + U(1)] * ds
                g += U(1)


@njit(parallel=True, cache=True)
def value_outliers(probs, codes, n_words, vlut, bits, heads, scale_zero, pointers, channels, values, code_under,
                   chan_head, chan_pos, partial):
    """partial[part, b, hq, :] += probs[b, hq, t] * (exact - dequantized) over the value outliers of part's slots.

    probs float32 [B, Hq, T]; codes uint32 and scale_zero fp16 bits, flat, token-major: slot n's words from
    element n * n_words, its scale and zero-point at 2n and 2n + 1 (counts that vary have no pages); vlut float32
    [C, R]; pointers uint32 [T*B + 1]; channels uint16; values fp16 bits; code_under, chan_head, chan_pos: as
    `key_outliers`;
    partial float32 [parts, B, Hq, D], zero on entry, each part summed in its own slice (two slots may hit one
    (hq, channel)).
    """
    n_rows, n_tok = probs.shape[0], probs.shape[2]
    parts, _, hq_all, d = partial.shape
    n_chan, g_size = chan_head.shape[0], hq_all // heads
    bounds = sparse_parts(pointers, parts)
    c_acc, c_p = np.empty(n_chan, np.uint64), np.empty(n_chan, np.uint64)  # offsets of (h * G, j) in acc, probs
    for c in range(n_chan):
        c_acc[c] = chan_head[c] * g_size * d + chan_pos[c]
        c_p[c] = chan_head[c] * g_size * n_tok
    codes_flat, p_flat, sz_flat = codes.reshape(-1), probs.reshape(-1), scale_zero.reshape(-1)
    levels = vlut.reshape(-1)
    ub, uw, ug, ut, ud, un_rows = U(bits), U(n_words), U(g_size), U(n_tok), U(d), U(n_rows)
    uwidth, known, under = U(vlut.shape[1]), code_under >= 0, U(max(code_under, 0))
    for part in prange(parts):
        acc = partial[part].reshape(-1)  # [B * Hq * D]
        t, b = _steps(bounds[part], n_rows)
        for slot in range(U(bounds[part]), U(bounds[part + 1])):
            b += U(1)
            if b == un_rows:
                t, b = t + U(1), U(0)
            s, z = f16(sz_flat[U(2) * slot]), f16(sz_flat[U(2) * slot + U(1)])
            row_acc, row_p = b * U(hq_all) * ud, b * U(hq_all) * ut + t  # acc[b, 0, 0], probs[b, 0, t]
            for e in range(U(pointers[slot]), U(pointers[slot + U(1)])):
                c = U(channels[e])
                if c >= U(n_chan):  # NO_CHANNEL
                    continue
                level = levels[c * uwidth + (under if known else _code(codes_flat, slot * uw, c, ub))]
                delta = f16(values[e]) - (level * s + z)
                ia, ip = row_acc + c_acc[c], row_p + c_p[c]
                for g in range(ug):
                    acc[ia + g * ud] += p_flat[ip + g * ut] * delta


@njit(parallel=True, cache=True)
def value_outliers_fixed(probs, codes, rows, geo, shift, vlut, bits, heads, sz, fixed, channels, values, code_under,
                         chan_head, chan_pos, lanes):
    """`value_outliers` for fixed-count rows (every row holds `fixed` outliers: entries row * fixed + i),
    16 tokens at a time in vector lanes.

    probs float32 [B, Hq, T]; codes (uint32, flat), rows, geo, shift: as `keys.key_scores`; vlut float32
    [C, R]; sz float32 [2, B, T] (the planar scales and zero-points `value_sums` wrote); channels, values uint16,
    flat, where `geo` puts each slot's; code_under: as `key_outliers`;
    lanes float32 [parts, B, Hq, D, 16], zero on entry: part p adds its share into lanes[p], lane i for its
    i-th token of every 16, so no two lanes of one scatter ever touch one element, whatever the channels.
    Every part takes an equal range of tokens, hence an equal number of non-zeros. The caller sums the lanes.
    """
    n_rows, n_tok, stride = probs.shape[0], probs.shape[2], rows.shape[1]
    parts, _, hq_all, d, _ = lanes.shape
    n_chan, g_size = chan_head.shape[0], hq_all // heads
    c_acc, c_p = np.empty(n_chan, np.uint32), np.empty(n_chan, np.uint32)  # offsets of (h * G, j) in lanes, probs
    for c in range(n_chan):
        c_acc[c] = (chan_head[c] * g_size * d + chan_pos[c]) * LANES
        c_p[c] = chan_head[c] * g_size * n_tok
    codes_flat, p_flat, sz_flat = codes.reshape(-1), probs.reshape(-1), sz.reshape(-1)
    table = vload(vlut, 0)  # read only where codes vary under outliers, which needs one width for all channels
    under_c = np.ascontiguousarray(vlut[:, max(code_under, 0)])  # [C]: each channel's level under its outliers
    last_word = min(codes_flat.shape[0] - 1, 0xFFFFFFFF)  # a straddle read never leaves the array
    lane = ulanes()
    for part in prange(parts):
        acc = lanes[part].reshape(-1)
        t_lo, t_hi = n_tok * part // parts, n_tok * (part + 1) // parts
        for b in range(n_rows):
            acc_row, p_row = b * hq_all * d * LANES, b * hq_all * n_tok
            for t0 in range(t_lo, t_hi, LANES):
                n = min(LANES, t_hi - t0)
                s = vload_first(sz_flat, b * n_tok + t0, n)  # zero past n: those lanes add p * 0
                z = vload_first(sz_flat, (n_rows + b) * n_tok + t0, n)
                r = vload_first(rows, b * stride + t0, n)  # each lane's slot
                w_lane = vat(r, geo, V_CODES, shift)  # its word 0, its first channel and its first value
                c_lane, v_lane = vat(r, geo, V_CHANNELS, shift), vat(r, geo, V_VALUES, shift)
                for i in range(fixed):
                    c, raw = vindex16(channels, i, c_lane, n), vindex16(values, i, v_lane, n)
                    named = vbelow(c, n_chan)  # 0.0 for an empty entry (NO_CHANNEL), which then adds p * 0
                    c = umin(c, n_chan - 1)
                    if code_under >= 0:
                        level = vindex(under_c, 0, c, n)
                    else:
                        off = umul(c, bits)
                        w = uadd(w_lane, ushr(off, 5))
                        level = vlookup(table, vfunnel(vindex(codes_flat, 0, w, n),
                                                       vindex(codes_flat, 0, umin(uadd(w, 1), last_word), n),
                                                       uand(off, 31)))
                    delta = vmul(vsub(vhalf(raw), vadd(vmul(level, s), z)), named)
                    ia = uadd(vindex(c_acc, 0, c, n), lane)
                    ip = uadd(vindex(c_p, 0, c, n), lane)
                    for g in range(g_size):
                        p = vindex(p_flat, p_row + g * n_tok + t0, ip, n)
                        a = vindex(acc, acc_row + g * d * LANES, ia, n)
                        vscatter(acc, acc_row + g * d * LANES, ia, vadd(a, vmul(p, delta)), n)
