"""The paged layout's page work on CPU, compiled with numba: quantize tokens into their slots, and read
sequences back through their block tables.

`kvsqueeze.paged.layout.PageLayout` writes and reads pages with torch ops (the reference) or with these
kernels; both give the same bytes and the same floats (the tests hold them to that). A serving engine calls
them on every layer of every step, where the torch version's dozens of small ops per call cost more than the
arithmetic:

* `write_tokens`: one pass per token (tokens in parallel) does what `PageLayout.write` does with torch: the
  pre-RoPE key against each channel's offline range and codebook, the token's `key_slots` exact elements (its
  outliers first, the farthest past the range when it has more; then the in-range elements its codes round
  worst), the value's top-k outliers per side, its fp16 scale and zero-point and its codes; packs the codes
  and stores everything straight into the token's slot of its page. The arithmetic is `numerics/affine.py`'s, operation
  for operation in float32 (fp16 rounding by the hardware's conversion), so codes and scales are bit for bit
  those of the torch path. (Where elements tie exactly for the last exact slot, this kernel keeps the lower
  channel; torch's top-k may keep the other: either is a valid choice);
* `read_sequence`: a sequence's keys (pre-RoPE) and values, float32 [T, C], dequantized straight from its
  pages through its block table (what a prefill chunk attends);
* `gather_rows`: one region of every token of a batch of sequences, token-major [T, B, w], through their block
  tables, dead slots zeroed (what the decode kernel reads);
* `put_halves`: float32 keys and values as fp16 into a flat buffer at each token's first element (a step's
  fp16 window entries);
* `sinks_and_window`: each decode row's sinks and fp16 window entries side by side, as the decode kernel reads
  them.

Page regions arrive as numpy views of the page buffer (strided: a region is a slice of every page), with
16-bit floats as their uint16 bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..view import NO_CHANNEL
from .common import code_at
from .simd import f16, half_bits

_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_NO_CHANNEL = np.uint16(NO_CHANNEL)
_MIN_SCALE = np.float32(1e-6)  # affine._MIN_SCALE, as torch compares it: a float32


@njit(cache=True, inline="always")
def _rounded(x):
    """float32 x rounded to fp16 and back (how scales and zero-points are stored)."""
    return f16(half_bits(x))


@njit(cache=True, inline="always")
def _pack(codes, offs, words):
    """codes uint8 [C] -> words uint32 [W], the stream `packing.pack_codes` / `pack_mixed` write (code c at stream
    bit offs[c], its width offs[c + 1] - offs[c]; a code may straddle two words), zero padding after the last."""
    for w in range(words.shape[0]):
        words[w] = 0
    for c in range(codes.shape[0]):
        off = offs[c]
        wi, sh = off >> 5, off & 31
        v = np.uint64(codes[c]) << np.uint64(sh)
        words[wi] |= np.uint32(v & np.uint64(0xFFFFFFFF))
        if sh + offs[c + 1] - off > 32:
            words[wi + 1] |= np.uint32(v >> np.uint64(32))


@njit(cache=True, inline="always")
def _nearest(err, mids, qi):
    """qi[j] = the nearest level of err[j] in channel j's codebook: the count of its midpoints below err[j]
    (mids float32 [M, C], +inf past a channel's own), counted without a branch."""
    for j in range(err.shape[0]):
        qi[j] = 0
    for i in range(mids.shape[0]):
        row = mids[i]
        for j in range(err.shape[0]):
            qi[j] += row[j] < err[j]


@njit(cache=True, inline="always")
def _top(x, k, side, idx, val, skip=None):
    """The k largest (side 1) or smallest (side -1) entries of x [C] into idx/val [k + 1], best first, in one pass;
    ties keep the lower channel first; channels where `skip` [C] is True are passed over. Returns how many were
    found (min(k, C))."""
    m = 0
    for c in range(x.shape[0]):
        if skip is not None and skip[c]:
            continue
        v = x[c] if side > 0 else -x[c]
        if m == k and not v > val[k - 1]:
            continue
        i = m if m < k else k - 1
        while i > 0 and v > val[i - 1]:  # shift the worse ones down
            val[i], idx[i] = val[i - 1], idx[i - 1]
            i -= 1
        val[i], idx[i] = v, c
        if m < k:
            m += 1
    return m


@njit(parallel=True, cache=True, error_model="numpy")  # no zero-division branch: scales are >= 1e-6
def write_tokens(xk, xv, block, offset, positions, sinks, c0, cl, k_mids, k_levels, k_scale, k_zero, k_lo, k_hi,
                 k_offs, key_slots, v_mids, v_levels, v_offs, v_side, r_kcodes, r_vcodes, r_sz, r_kch, r_kval, r_vch,
                 r_vval, r_sink_k, r_sink_v, clipped):
    """Quantize tokens n < N into slot (block[n], offset[n]) of their pages; see the module docstring.

    Args:
        xk, xv: float32 [N, C] pre-RoPE keys and values; block, offset, positions: int64 [N].
        sinks: positions below it are stored exactly (sink area of the page).
        c0, cl: the pages hold channels c0 .. c0 + cl of every token (a rank's share; 0, C: all): their codes and
            sinks, each token's scale and zero-point, and its slots renumbered from c0, those of other channels
            `NO_CHANNEL` (value 0) after them. Everything else is computed from the whole token.
        k_mids, k_levels: float32 each channel's key boundaries [M, C] (+inf past its own) and levels [C, L];
            k_scale, k_zero: float32 [C] (fp16 values); k_lo, k_hi: float32 [C] calibrated range; k_offs: int64
            [cl + 1] stream bit offsets of the share's codes; key_slots: exact key elements per token (0: none).
        v_mids, v_levels, v_offs: the values'; v_side: value outliers per side of each token (0: none).
        r_*: the page regions (`layout.regions`), written.
        clipped: int64 [N], written: the token's outliers that did not get a slot.
    """
    n_tok, c = xk.shape
    vk = r_vch.shape[2]
    chunks = min(n_tok, 64)
    for ch in prange(chunks):  # scratch allocated once per chunk of tokens, not per token
        codes = np.empty(c, np.uint8)
        words_k = np.empty(r_kcodes.shape[2], np.uint32)
        words_v = np.empty(r_vcodes.shape[2], np.uint32)
        err = np.empty(c, np.float32)
        qi = np.empty(c, np.int32)
        past = np.empty(c, np.bool_)
        taken = np.empty(c, np.bool_)
        idx = np.empty(max(key_slots, v_side + 1) + 1, np.int64)
        val = np.empty(max(key_slots, v_side + 1) + 1, np.float32)
        for n in range(n_tok * ch // chunks, n_tok * (ch + 1) // chunks):
            p, o = block[n], offset[n]
            sink = positions[n] < sinks
            # keys: nearest level of each channel's normalized element
            xn = xk[n]
            for j in range(c):  # simple loops over contiguous float32 rows: LLVM vectorizes them
                err[j] = (xn[j] - k_zero[j]) / k_scale[j]
            _nearest(err, k_mids, qi)
            worst = np.float32(0.0)
            for j in range(c):
                x = xn[j]
                q = qi[j]
                codes[j] = q
                e = abs(k_levels[j, q] * k_scale[j] + k_zero[j] - x)
                err[j] = e
                past[j] = x < k_lo[j] or x > k_hi[j]
                worst = max(worst, e)
            over = 0
            if key_slots > 0:
                for j in range(c):  # an outlier ranks above every in-range element, the farthest first
                    taken[j] = False
                    if past[j]:
                        err[j] = err[j] + worst + _ONE
                for i in range(_top(err, key_slots, 1, idx, val)):
                    taken[idx[i]] = True
                s = 0
                for j in range(c):
                    if taken[j]:
                        if c0 <= j < c0 + cl:
                            r_kch[p, o, s] = np.uint16(j - c0)
                            r_kval[p, o, s] = half_bits(xk[n, j])
                            s += 1
                        codes[j] = 0
                    elif past[j]:
                        over += 1
                for i in range(s, key_slots):
                    r_kch[p, o, i] = _NO_CHANNEL
                    r_kval[p, o, i] = 0
            clipped[n] = over
            if sink:
                codes[:] = 0
            _pack(codes[c0:c0 + cl], k_offs, words_k)
            for i in range(words_k.shape[0]):
                r_kcodes[p, o, i] = words_k[i]
            # values: the token's range between its top-k outliers per side, its fp16 scale and zero-point
            for j in range(c):
                taken[j] = False
            lo = hi = xv[n, 0]
            if v_side > 0:
                _top(xv[n], v_side + 1, 1, idx, val)
                hi = xv[n, idx[v_side]]
                for i in range(v_side):
                    taken[idx[i]] = True
                _top(xv[n], v_side + 1, -1, idx, val, taken)  # among those the largest left: ties as the store's
                lo = xv[n, idx[v_side]]
                for i in range(v_side):
                    taken[idx[i]] = True
            else:
                for j in range(c):
                    lo, hi = min(lo, xv[n, j]), max(hi, xv[n, j])
            zero = _rounded((hi + lo) * _HALF)
            scale = max(_rounded(max((hi - lo) * _HALF, _MIN_SCALE)), _MIN_SCALE)
            xn = xv[n]
            for j in range(c):
                err[j] = (xn[j] - zero) / scale
            _nearest(err, v_mids, qi)
            s = 0
            for j in range(c):
                if taken[j]:
                    codes[j] = 0
                    if s < vk and c0 <= j < c0 + cl:
                        r_vch[p, o, s] = np.uint16(j - c0)
                        r_vval[p, o, s] = half_bits(xn[j])
                        s += 1
                else:
                    codes[j] = qi[j]
            for i in range(s, vk):
                r_vch[p, o, i] = _NO_CHANNEL
                r_vval[p, o, i] = 0
            if sink:
                codes[:] = 0
                r_sz[p, o, 0] = 0
                r_sz[p, o, 1] = 0
                for j in range(cl):
                    r_sink_k[p, positions[n], j] = half_bits(xk[n, c0 + j])
                    r_sink_v[p, positions[n], j] = half_bits(xv[n, c0 + j])
            else:
                r_sz[p, o, 0] = half_bits(scale)
                r_sz[p, o, 1] = half_bits(zero)
            _pack(codes[c0:c0 + cl], v_offs, words_v)
            for i in range(words_v.shape[0]):
                r_vcodes[p, o, i] = words_v[i]


@njit(parallel=True, cache=True)
def read_sequence(table, length, bs, sinks, k_offs, v_offs, k_levels, k_scale, k_zero, v_levels, r_kcodes,
                  r_vcodes, r_sz, r_kch, r_kval, r_vch, r_vval, r_sink_k, r_sink_v, keys, values):
    """Keys (pre-RoPE) and values float32 [T, C] of one sequence's first T = `length` tokens, read from its pages
    (`table` int [>= pages]) as `kernels.reference.dequantize_view` reconstructs them: level * scale + zero,
    each exact element in place, the sinks whole. Levels float32 [C, L] per channel, codes at stream bits offs
    [C + 1]."""
    c = keys.shape[1]
    for t in prange(length):
        p, o = table[t // bs], t % bs
        for j in range(c):
            kc = code_at(r_kcodes[p, o], 0, k_offs[j], k_offs[j + 1] - k_offs[j])
            keys[t, j] = k_levels[j, kc] * k_scale[j] + k_zero[j]
        for s in range(r_kch.shape[2]):
            if r_kch[p, o, s] < c:  # NO_CHANNEL: an empty slot (a rank's share)
                keys[t, np.int64(r_kch[p, o, s])] = f16(r_kval[p, o, s])
        scale, zero = f16(r_sz[p, o, 0]), f16(r_sz[p, o, 1])
        for j in range(c):
            values[t, j] = v_levels[j, code_at(r_vcodes[p, o], 0, v_offs[j], v_offs[j + 1] - v_offs[j])] * scale + zero
        for s in range(r_vch.shape[2]):
            if r_vch[p, o, s] < c:
                values[t, np.int64(r_vch[p, o, s])] = f16(r_vval[p, o, s])
        if t < sinks:
            first = table[0]
            for j in range(c):
                keys[t, j] = f16(r_sink_k[first, t, j])
                values[t, j] = f16(r_sink_v[first, t, j])


@njit(parallel=True, cache=True)
def gather_rows(region, table, lens, bs, out):
    """out[t, b] = region[table[b, t // bs], t % bs] for t < lens[b], zero past it; out [T, B, w]."""
    n_tok, n_rows, w = out.shape
    for t in prange(n_tok):
        for b in range(n_rows):
            if t < lens[b]:
                p, o = table[b, t // bs], t % bs
                for i in range(w):
                    out[t, b, i] = region[p, o, i]
            else:
                for i in range(w):
                    out[t, b, i] = 0


@njit(cache=True)
def put_halves(dst, starts, shift, keys, values, second):
    """dst[starts[i] + shift + c] = keys[i, c] and dst[starts[i] + shift + second + c] = values[i, c], each rounded
    to fp16 (to nearest, ties to even, as torch's `.half()`) and stored as its bits, for every token i of keys and
    values float32 [N, C] whose start is not negative (a padding token's is -1): a step's fp16 window entries
    written into the window's pages (a flat uint16 view) in one call instead of torch's indexing."""
    w = keys.shape[1]
    for i in range(starts.shape[0]):
        if starts[i] < 0:
            continue
        at = starts[i] + shift
        for c in range(w):
            dst[at + c] = half_bits(keys[i, c])
            dst[at + second + c] = half_bits(values[i, c])


@njit(cache=True)
def sinks_and_window(sink_k, sink_v, first, words, starts, shift, second, out_k, out_v):
    """out_k[b], out_v[b] int16 [S + W, C] (fp16 bits) of every decode row b: the S sinks of its first page
    (`first[b]` of sink_k, sink_v [blocks, S, C], a layer's sink regions), then its W window entries, entry w's keys
    from words[starts[b, w] + shift ...] and its values `second` words further (C of each; a start of -1, a
    position before the sequence's first: zeros). One pass instead of a row copy per entry and two joins."""
    rows, width, c = out_k.shape
    n_sinks = sink_k.shape[1]
    for b in range(rows):
        p = first[b]
        for s in range(n_sinks):
            for i in range(c):
                out_k[b, s, i] = sink_k[p, s, i]
                out_v[b, s, i] = sink_v[p, s, i]
        for w in range(width - n_sinks):
            at = starts[b, w]
            if at < 0:
                for i in range(c):
                    out_k[b, n_sinks + w, i] = 0
                    out_v[b, n_sinks + w, i] = 0
            else:
                at += shift
                for i in range(c):
                    out_k[b, n_sinks + w, i] = words[at + i]
                    out_v[b, n_sinks + w, i] = words[at + second + i]

