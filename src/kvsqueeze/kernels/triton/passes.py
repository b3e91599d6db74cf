"""Triton programs of the GPU backend: the key pass, the sparse passes, the value pass and its combine.

Every program reads the store's own arrays (`StoreView`): packed codes int32
(one bit stream per slot, `kvsqueeze.numerics.packing`), fp16 scales and outliers,
int32 positions [T, B]. Each slot n = t * B + b's data starts where int64
bases say (`attend._bases`): n times its width in a store's token-major
arrays, its place in its page in a paged cache, read in place. Shapes that change the code (head width, GQA group, bits,
block sizes) are `tl.constexpr`, so each combination compiles once.

RoPE is applied in registers: a channel pair (j, j + R/2) of a key at position
p turns by cos / sin(p * f_j), taken from tables factorised over p = hi + lo
(`tables`), so a block of keys needs two small table reads and no
[positions, R/2] table. Channels from R on (partial rotary) pass unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOW = 64  # positions per low RoPE table: p = hi * LOW + lo


@triton.jit
def _codes(codes_ptr, offs_ptr, row, chan, mask, BITS: tl.constexpr):
    """Codes of channels `chan` in the slots whose first word is at `row` (broadcast together), int32.

    BITS 0: channels have widths of their own; channel c's code is stream bits offs[c] .. offs[c + 1]."""
    if BITS == 0:
        off = tl.load(offs_ptr + chan, mask=mask, other=0)
        width = tl.load(offs_ptr + chan + 1, mask=mask, other=1) - off
    else:
        off = chan * BITS
        width = BITS
    word = off >> 5
    shift = off & 31
    lo = tl.load(codes_ptr + row + word, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    if BITS != 2 and BITS != 4:  # 2- and 4-bit codes of one width never straddle two words
        spill = mask & (shift + width > 32)
        hi = tl.load(codes_ptr + row + word + 1, mask=spill, other=0).to(tl.int64) & 0xFFFFFFFF
        lo = lo | (hi << 32)
    return ((lo >> shift) & ((1 << width) - 1)).to(tl.int32)


@triton.jit
def _cos_sin(pos, j, mask, cos_hi, sin_hi, cos_lo, sin_lo, HALF: tl.constexpr):
    """cos, sin of pair j at positions pos (broadcast together): angle(hi + lo) from the two tables."""
    hi = pos // 64
    lo = pos - hi * 64
    ch = tl.load(cos_hi + hi * HALF + j, mask=mask, other=1.0)
    sh = tl.load(sin_hi + hi * HALF + j, mask=mask, other=0.0)
    cl = tl.load(cos_lo + lo * HALF + j, mask=mask, other=1.0)
    sl = tl.load(sin_lo + lo * HALF + j, mask=mask, other=0.0)
    return ch * cl - sh * sl, sh * cl + ch * sl


@triton.jit
def key_scores(q_ptr, codes_ptr, offs_ptr, klut_ptr, pos_ptr, cos_hi, sin_hi, cos_lo, sin_lo, scores_ptr,
               kbase_ptr, T, B, H, HQ,
               D: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
               PASS: tl.constexpr, PASS_P: tl.constexpr, BITS: tl.constexpr, KROW: tl.constexpr,
               BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    """Raw scores q . RoPE(k) [B, Hq, T] of one block of BLOCK_T tokens and one KV head (all G query heads of
    its group), the keys dequantized from their codes by each channel's lookup table. Slot n = t * B + b's
    codes start at element kbase[n] of the flat codes."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    row = tl.load(kbase_ptr + t * B + b, mask=tmask, other=0)[:, None]
    pos = tl.load(pos_ptr + t * B + b, mask=tmask, other=0)[:, None]
    g = tl.arange(0, G_P)
    gmask = g < G
    qrow = ((b * HQ + h * G + g) * D)[:, None]  # [G_P, 1]
    j = tl.arange(0, HALF_P)[None, :]
    m = tmask[:, None] & (j < HALF)
    c_lo = h * D + j
    k_lo = tl.load(klut_ptr + c_lo * KROW + _codes(codes_ptr, offs_ptr, row, c_lo, m, BITS), mask=m, other=0.0)
    c_hi = c_lo + HALF
    k_hi = tl.load(klut_ptr + c_hi * KROW + _codes(codes_ptr, offs_ptr, row, c_hi, m, BITS), mask=m, other=0.0)
    cos, sin = _cos_sin(pos, j, m, cos_hi, sin_hi, cos_lo, sin_lo, HALF)
    r_lo = k_lo * cos - k_hi * sin
    r_hi = k_hi * cos + k_lo * sin
    qm = gmask[:, None] & (j < HALF)
    q_lo = tl.load(q_ptr + qrow + j, mask=qm, other=0.0)
    q_hi = tl.load(q_ptr + qrow + HALF + j, mask=qm, other=0.0)
    acc = (tl.dot(q_lo, tl.trans(r_lo), input_precision=PRECISION)  # [G_P, BLOCK_T] on the matrix units
           + tl.dot(q_hi, tl.trans(r_hi), input_precision=PRECISION))
    if PASS > 0:  # partial rotary: channels 2 * HALF .. D do not turn
        p = tl.arange(0, PASS_P)[None, :]
        pm = tmask[:, None] & (p < PASS)
        c_p = h * D + 2 * HALF + p
        k_p = tl.load(klut_ptr + c_p * KROW + _codes(codes_ptr, offs_ptr, row, c_p, pm, BITS), mask=pm, other=0.0)
        q_p = tl.load(q_ptr + qrow + 2 * HALF + p, mask=gmask[:, None] & (p < PASS), other=0.0)
        acc += tl.dot(q_p, tl.trans(k_p), input_precision=PRECISION)
    out = scores_ptr + ((b * HQ + h * G + g) * T)[:, None] + t[None, :]
    tl.store(out, acc, mask=gmask[:, None] & tmask[None, :])


@triton.jit
def _in_use(ptr_ptr, e, NNZ, SLOTS, FIXED: tl.constexpr):
    """Whether entry e holds an outlier: below NNZ and, with pointers, below pointers[SLOTS] (past it lies room
    a decode step left, which the host has not cut off yet)."""
    emask = e < NNZ
    if FIXED == 0:
        emask = emask & (e < tl.load(ptr_ptr + SLOTS))
    return emask


@triton.jit
def _slot_of(ptr_ptr, e, emask, SLOTS, FIXED: tl.constexpr, STEPS: tl.constexpr):
    """The slot n of each entry e: n = e // FIXED, or the last n with pointers[n] <= e (binary search)."""
    if FIXED > 0:
        return e // FIXED
    lo = tl.zeros_like(e)
    hi = tl.zeros_like(e) + SLOTS - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        take = tl.load(ptr_ptr + mid, mask=emask, other=0) <= e
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


@triton.jit
def _entries(cbase_ptr, xbase_ptr, e, n, mask, FIXED: tl.constexpr):
    """Where entry e (of slot n) lies in the channels and in the values array: with a fixed count per slot,
    cbase[n] / xbase[n] plus its place among the slot's entries (slots may lie anywhere, as in pages); with
    pointers, at e in both."""
    if FIXED > 0:
        i = e - n * FIXED
        return ((tl.load(cbase_ptr + n, mask=mask, other=0) + i).to(tl.int64),
                (tl.load(xbase_ptr + n, mask=mask, other=0) + i).to(tl.int64))
    return e.to(tl.int64), e.to(tl.int64)  # one type on both paths: the compiler types every return alike


@triton.jit
def _is_sink(sink_slot, b, t, mask, S: tl.constexpr):
    hit = t < 0
    for s in tl.static_range(S):
        hit = hit | (tl.load(sink_slot + b * S + s, mask=mask, other=-1) == t)
    return hit


@triton.jit
def key_outliers(q_ptr, codes_ptr, offs_ptr, klut_ptr, pos_ptr, cos_hi, sin_hi, cos_lo, sin_lo, scores_ptr,
                 ptr_ptr, chan_ptr, val_ptr, kbase_ptr, cbase_ptr, xbase_ptr, NNZ, SLOTS, T, B, HQ, UNDER,
                 D: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr, KROW: tl.constexpr,
                 FIXED: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Key outliers (CSC over slots), BLOCK entries a program whatever their slots: each replaces its element
    before RoPE, so it adds q . RoPE(exact - dequantized), which touches the element's channel and its pair.
    Entries of a fixed count per slot lie where the bases say (`_entries`)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    emask = _in_use(ptr_ptr, e, NNZ, SLOTS, FIXED)
    n = _slot_of(ptr_ptr, e, emask, SLOTS, FIXED, STEPS)
    t = n // B
    b = n - t * B
    ce, xe = _entries(cbase_ptr, xbase_ptr, e, n, emask, FIXED)
    c = tl.load(chan_ptr + ce, mask=emask, other=0).to(tl.int32) & 0xFFFF
    emask = emask & (c < (HQ // G) * D)  # NO_CHANNEL: an empty entry
    if UNDER >= 0:
        code = tl.zeros_like(c) + UNDER
    else:
        code = _codes(codes_ptr, offs_ptr, tl.load(kbase_ptr + n, mask=emask, other=0), c, emask, BITS)
    delta = tl.load(val_ptr + xe, mask=emask, other=0.0).to(tl.float32) - tl.load(
        klut_ptr + c * KROW + code, mask=emask, other=0.0)
    h = c // D
    d = c - h * D
    turns = d < 2 * HALF
    first = d < HALF
    pair = tl.where(first, d, d - HALF)
    cos, sin = _cos_sin(tl.load(pos_ptr + t * B + b, mask=emask, other=0), pair, emask & turns,
                        cos_hi, sin_hi, cos_lo, sin_lo, HALF)
    cos = tl.where(turns, cos, 1.0)
    sin = tl.where(turns, tl.where(first, sin, -sin), 0.0)
    partner = tl.where(first, d + HALF, d - HALF)
    for g in tl.static_range(G):
        r = b * HQ + h * G + g
        qa = tl.load(q_ptr + r * D + d, mask=emask, other=0.0)
        qb = tl.load(q_ptr + r * D + partner, mask=emask & turns, other=0.0)
        tl.atomic_add(scores_ptr + r * T + t, delta * (qa * cos + qb * sin), mask=emask)


@triton.jit
def sink_scores(q_ptr, sink_k, sink_slot, pos_ptr, cos_hi, sin_hi, cos_lo, sin_lo, scores_ptr, T, B, H, HQ,
                S: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, HALF: tl.constexpr,
                HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr):
    """The scores of each row's sinks from their exact fp16 keys, overwriting what the codes gave."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    slot = tl.load(sink_slot + b * S + s)
    if slot >= 0:
        c = H * D
        base = sink_k + (b * S + s) * c + h * D
        j = tl.arange(0, HALF_P)
        jm = j < HALF
        k_lo = tl.load(base + j, mask=jm, other=0.0).to(tl.float32)
        k_hi = tl.load(base + HALF + j, mask=jm, other=0.0).to(tl.float32)
        cos, sin = _cos_sin(tl.load(pos_ptr + slot * B + b), j, jm, cos_hi, sin_hi, cos_lo, sin_lo, HALF)
        r_lo = k_lo * cos - k_hi * sin
        r_hi = k_hi * cos + k_lo * sin
        g = tl.arange(0, G_P)
        gm = g < G
        qrow = ((b * HQ + h * G + g) * D)[:, None]
        qm = gm[:, None] & jm[None, :]
        acc = tl.sum(tl.load(q_ptr + qrow + j[None, :], mask=qm, other=0.0) * r_lo[None, :], axis=1)
        acc += tl.sum(tl.load(q_ptr + qrow + HALF + j[None, :], mask=qm, other=0.0) * r_hi[None, :], axis=1)
        if PASS > 0:
            p = tl.arange(0, PASS_P)
            pm = p < PASS
            k_p = tl.load(base + 2 * HALF + p, mask=pm, other=0.0).to(tl.float32)
            q_p = tl.load(q_ptr + qrow + 2 * HALF + p[None, :], mask=gm[:, None] & pm[None, :], other=0.0)
            acc += tl.sum(q_p * k_p[None, :], axis=1)
        tl.store(scores_ptr + (b * HQ + h * G + g) * T + slot, acc, mask=gm)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def value_partial(scores_ptr, mask_ptr, codes_ptr, offs_ptr, vlut_ptr, sz_ptr, vbase_ptr, szbase_ptr, sink_v,
                  sink_slot, m_ptr, l_ptr, acc_ptr, scaling, softcap, T, B, H, HQ, SPLIT_T, NSPLIT,
                  S: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr,
                  BITS: tl.constexpr, VROW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                  BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    """One split of the tokens for one KV head (flash-decoding): the scores scaled, capped and masked (written
    back, for the value outliers), their running maximum and sum, and sum_t p_t v_t with each value dequantized
    from its codes and its slot's fp16 scale and zero-point; a sink's slot takes its exact fp16 value."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = tl.arange(0, G_P)
    gm = g < G
    r = b * HQ + h * G + g  # [G_P]
    d = tl.arange(0, D_P)
    dm = d < D
    c = h * D + d
    m_run = tl.zeros([G_P], dtype=tl.float32) - float("inf")
    l_run = tl.zeros([G_P], dtype=tl.float32)
    acc = tl.zeros([G_P, D_P], dtype=tl.float32)
    start = split * SPLIT_T
    stop = tl.minimum(start + SPLIT_T, T)
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < stop
        sm = gm[:, None] & tm[None, :]
        sp = scores_ptr + (r * T)[:, None] + t[None, :]
        s = tl.load(sp, mask=sm, other=0.0) * scaling
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        keep = tm
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * T + t, mask=tm, other=0) != 0)
        s = tl.where(keep[None, :], s, float("-inf"))
        tl.store(sp, s, mask=sm)
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        alive = m_new > float("-inf")
        alpha = tl.where(alive, tl.exp(m_run - m_new), 1.0)
        p = tl.where(alive[:, None], tl.exp(s - m_new[:, None]), 0.0)
        vm = tm[:, None] & dm[None, :]
        vrow = tl.load(vbase_ptr + t * B + b, mask=tm, other=0)
        code = _codes(codes_ptr, offs_ptr, vrow[:, None], c[None, :], vm, BITS)
        level = tl.load(vlut_ptr + c[None, :] * VROW + code, mask=vm, other=0.0)
        szrow = tl.load(szbase_ptr + t * B + b, mask=tm, other=0)
        scale = tl.load(sz_ptr + szrow, mask=tm, other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + szrow + 1, mask=tm, other=0.0).to(tl.float32)
        v = level * scale[:, None] + zero[:, None]
        for i in tl.static_range(S):
            slot = tl.load(sink_slot + b * S + i)
            exact = tl.load(sink_v + (b * S + i) * (H * D) + c, mask=dm, other=0.0).to(tl.float32)
            v = tl.where((t == slot)[:, None], exact[None, :], v)
        l_run = l_run * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)  # [G_P, D_P]
        m_run = m_new
    part = r * NSPLIT + split
    tl.store(m_ptr + part, m_run, mask=gm)
    tl.store(l_ptr + part, l_run, mask=gm)
    tl.store(acc_ptr + (part * D)[:, None] + d[None, :], acc, mask=gm[:, None] & dm[None, :])


@triton.jit
def combine(m_ptr, l_ptr, acc_ptr, sink_logit_ptr, out_ptr, stats_ptr, HQ, NSPLIT,
            D: tl.constexpr, D_P: tl.constexpr, NS_P: tl.constexpr, HAS_SINK_LOGIT: tl.constexpr):
    """out = sum_s exp(m_s - M) acc_s / L over the splits of one (row, query head); M and L (the softmax
    maximum and sum, a learned sink logit included) are kept for the value outliers."""
    r = tl.program_id(0)
    s = tl.arange(0, NS_P)
    sm = s < NSPLIT
    m = tl.load(m_ptr + r * NSPLIT + s, mask=sm, other=float("-inf"))
    l = tl.load(l_ptr + r * NSPLIT + s, mask=sm, other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINK_LOGIT:
        extra = tl.load(sink_logit_ptr + r % HQ)
        top = tl.maximum(top, extra)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    total = tl.sum(w * l, axis=0)
    if HAS_SINK_LOGIT:
        total += tl.exp(extra - top)
    d = tl.arange(0, D_P)
    dm = d < D
    acc = tl.load(acc_ptr + ((r * NSPLIT + s) * D)[:, None] + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    tl.store(out_ptr + r * D + d, tl.sum(w[:, None] * acc, axis=0) / total, mask=dm)
    tl.store(stats_ptr + r * 2, top)
    tl.store(stats_ptr + r * 2 + 1, total)


@triton.jit
def value_outliers(codes_ptr, offs_ptr, vlut_ptr, sz_ptr, vbase_ptr, szbase_ptr, sink_slot, scores_ptr, stats_ptr,
                   out_ptr, ptr_ptr, chan_ptr, val_ptr, cbase_ptr, xbase_ptr, NNZ, SLOTS, T, B, HQ, UNDER,
                   S: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, VROW: tl.constexpr,
                   FIXED: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Value outliers (CSR over slots), BLOCK entries a program: each adds p_t (exact - dequantized) to its
    channel of the output, p_t the token's final softmax weight. Sink slots are skipped (their exact values
    were read in the value pass)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    emask = _in_use(ptr_ptr, e, NNZ, SLOTS, FIXED)
    n = _slot_of(ptr_ptr, e, emask, SLOTS, FIXED, STEPS)
    t = n // B
    b = n - t * B
    emask = emask & ~_is_sink(sink_slot, b, t, emask, S)
    ce, xe = _entries(cbase_ptr, xbase_ptr, e, n, emask, FIXED)
    c = tl.load(chan_ptr + ce, mask=emask, other=0).to(tl.int32) & 0xFFFF
    emask = emask & (c < (HQ // G) * D)  # NO_CHANNEL: an empty entry
    if UNDER >= 0:
        code = tl.zeros_like(c) + UNDER
    else:
        code = _codes(codes_ptr, offs_ptr, tl.load(vbase_ptr + n, mask=emask, other=0), c, emask, BITS)
    szrow = tl.load(szbase_ptr + n, mask=emask, other=0)
    scale = tl.load(sz_ptr + szrow, mask=emask, other=0.0).to(tl.float32)
    zero = tl.load(sz_ptr + szrow + 1, mask=emask, other=0.0).to(tl.float32)
    stored = tl.load(vlut_ptr + c * VROW + code, mask=emask, other=0.0) * scale + zero
    delta = tl.load(val_ptr + xe, mask=emask, other=0.0).to(tl.float32) - stored
    h = c // D
    d = c - h * D
    for g in tl.static_range(G):
        r = b * HQ + h * G + g
        top = tl.load(stats_ptr + r * 2, mask=emask, other=0.0)
        total = tl.load(stats_ptr + r * 2 + 1, mask=emask, other=1.0)
        s = tl.load(scores_ptr + r * T + t, mask=emask, other=float("-inf"))
        w = tl.where(s > float("-inf"), tl.exp(s - top), 0.0) / total
        tl.atomic_add(out_ptr + r * D + d, w * delta, mask=emask)
