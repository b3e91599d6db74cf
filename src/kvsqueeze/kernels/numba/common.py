"""Pieces shared by the numba decode kernels: token blocks, RoPE blocks, word transposition, code decoding.

Layout conventions (see `attend.py` for the passes):

* work runs over blocks of `BLOCK` consecutive tokens of one batch row; vector
  lanes are 16 consecutive tokens (`simd.LANES`);
* token t of batch row b is slot rows[b, t]; each array is flat, and a slot's
  data starts at `at(slot, geo, array, shift)` (a store's token-major arrays:
  slot t * B + b, its row of the [T * B, W] array; a paged cache: the slot of
  its page, read in place); a block's words are gathered by slot and
  transposed into wb [words, width] (uint32) so that one channel's codes of 16
  tokens are a vector shift away;
* lookup tables are rows of 16 float32 (the 2**bits levels repeated to fill 16 lanes), one row per
  channel: keys with their scale and zero-point folded in, values the channel's levels; rows of 64 where
  channels of their own widths reach 5 or 6 bits;
* a channel's code starts at stream bit offs[c] of its slot (`offs` int32 [C + 1]; c * bits when every
  channel has the same width, the running sum of the widths when each has its own).

Small helpers are inlined into their callers (`inline="always"`): a call would
count references to the arrays it is passed on every invocation.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tables import BLOCK
from .simd import (
    LANES,
    uadd,
    uand,
    umul,
    ushr,
    vadd,
    vfunnel,
    vgather,
    vindex,
    vload,
    vload_first,
    vlookup,
    vlookup8,
    vmul,
    vpick,
    vstore,
    vstore_first,
    vsub,
)

SPAN = 4 * BLOCK  # tokens per value sub-block: their transposed words and weights stay in L1
TILE = 4  # query heads whose accumulators stay in registers together
ZERO = np.float32(0.0)


@njit(cache=True, inline="always")  # no call: a call would count references to its arrays
def cos_sin_at(p, j, cos_hi, sin_hi, cos_lo, sin_lo):
    hi = p // BLOCK
    lo = p - hi * BLOCK
    return (cos_hi[hi, j] * cos_lo[j, lo] - sin_hi[hi, j] * sin_lo[j, lo],
            sin_hi[hi, j] * cos_lo[j, lo] + cos_hi[hi, j] * sin_lo[j, lo])


@njit(cache=True, inline="always")
def block_rotation(q, b, positions, t0, n, cos_hi, sin_hi, cos_lo, sin_lo, qr, cs, sn):
    """Prepare the RoPE of the block of tokens t0..t0+n of row b; True if its positions are consecutive.

    Consecutive positions p0 + u (the usual case): RoPE(p0 + u) = RoPE(p0) RoPE(u), and
    q . RoPE(p0) RoPE(u) k = (RoPE(p0)^T q) . RoPE(u) k, so the block's queries are turned back by p0
    into qr [1, Hq, D] and every block rotates its keys by the fixed low tables (cos_lo, sin_lo at u):
    no per-block tables. Otherwise (padding restarts the positions inside the block) cs, sn [R/2, BLOCK]
    get cos/sin at each token's own position and q is used as it is. Channels from R on (partial rotary) are
    not turned: qr holds them as q does.
    """
    half, hq_all, d = cs.shape[0], q.shape[1], q.shape[2]
    p0 = positions[t0, b]
    for t in range(1, n):
        if positions[t0 + t, b] != p0 + t:
            for u in range(n):
                for j in range(half):
                    cs[j, u], sn[j, u] = cos_sin_at(positions[t0 + u, b], j, cos_hi, sin_hi, cos_lo, sin_lo)
            return False
    hi = p0 // BLOCK
    lo = p0 - hi * BLOCK
    for r in range(hq_all):
        for c in range(2 * half, d):
            qr[0, r, c] = q[b, r, c]
    for j in range(0, half, LANES):  # cos/sin of p0 at 16 pairs a vector, then every query head's pairs
        m = half - j
        ch, sh = vload_first(cos_hi, hi * half + j, m), vload_first(sin_hi, hi * half + j, m)
        cl, sl = vgather(cos_lo, j * BLOCK + lo, BLOCK, m), vgather(sin_lo, j * BLOCK + lo, BLOCK, m)
        c, s = vsub(vmul(ch, cl), vmul(sh, sl)), vadd(vmul(sh, cl), vmul(ch, sl))
        for r in range(hq_all):
            qx = vload_first(q, (b * hq_all + r) * d + j, m)
            qy = vload_first(q, (b * hq_all + r) * d + half + j, m)
            vstore_first(qr, r * d + j, vadd(vmul(qx, c), vmul(qy, s)), m)
            vstore_first(qr, r * d + half + j, vsub(vmul(qy, c), vmul(qx, s)), m)
    return True


@njit(cache=True, inline="always")
def head_words(offs, h, d):
    """(first word, word count) of KV head h's codes in a slot's stream."""
    w0 = offs[h * d] >> 5
    return w0, ((offs[(h + 1) * d] - 1) >> 5) - w0 + 1


@njit(cache=True)
def max_head_words(offs, heads, d):
    """The most words one head's codes take, and two more that `decode` may read past them."""
    most = 0
    for h in range(heads):
        most = max(most, head_words(offs, h, d)[1])
    return most + 2


# the arrays a view's storage geometry `geo` (int64 [7, 3]: page, width, offset per array) describes, in the order
# of `kernels.view.ARRAYS`
K_CODES, V_CODES, SCALE_ZERO, K_CHANNELS, K_VALUES, V_CHANNELS, V_VALUES = 0, 1, 2, 3, 4, 5, 6


@njit(cache=True, inline="always")
def at(s, geo, f, shift):
    """The first element of slot s's data in array f: (s >> shift) * page + (s & (2**shift - 1)) * width + offset
    (a store's token-major arrays: shift 0 and page = width, so s * width)."""
    s = np.int64(s)
    return (s >> shift) * geo[f, 0] + (s & ((1 << shift) - 1)) * geo[f, 1] + geo[f, 2]


@njit(cache=True, inline="always")
def vat(s, geo, f, shift):
    """`at` for 16 slots in uint32 lanes (elements below 2**31)."""
    return uadd(uadd(umul(ushr(s, shift), geo[f, 0]), umul(uand(s, (1 << shift) - 1), geo[f, 1])), geo[f, 2])


@njit(cache=True, inline="always")
def gather_words(codes, rows, geo, f, shift, b, t0, n, w0, nw, wb, width):
    """wb[i, t] = word w0 + i of token t0 + t in batch row b, for i < nw and t < n; zero for n <= t < width.

    codes uint32, flat; token t of row b is slot rows[b, t] (rows uint32 [B, >= T]), whose words start at
    `at(slot, geo, f, shift)` -> wb uint32 [*, width] (token-contiguous rows, for 16-token lanes).
    """
    stride = rows.shape[1]
    for k in range(0, width, LANES):
        valid = max(0, min(LANES, n - k))
        first = vat(vload_first(rows, b * stride + t0 + k, valid), geo, f, shift)  # each lane's word 0
        for i in range(nw):
            vstore(wb, i * width + k, vindex(codes, w0 + i, first, valid))


@njit(cache=True, inline="always")
def decode(wb, width, w0, offs, c, bits, lut, k):
    """Lanes k..k+15 (tokens) of channel c's code (stream bits offs[c] ..): lut[c, code], codes from the
    transposed words wb [*, width].

    Branch-free: one funnel shift of the code's word and the next brings the code to the low bits whether or
    not it straddles them, and the lookup reads only the low four bits (three for codes of at most 3 bits,
    `vlookup8`); the table repeats with period 2**width of the code, so the bits above the code select the same
    level. wb needs one row past the last
    word read. 2- and 4-bit codes of equal widths never straddle a word: they take one word and a shift instead
    (`bits` 0: channels of their own widths, every code funnel-shifted). Channels of their own widths may be 5
    or 6 bits wide (lut rows of 64 levels): such a code permutes two or four 16-level quarters of the row and
    picks between them by its bits 4 and 5 (`vpick`), about 5x faster than gathering its level on AVX-512 and
    2.4x (5 bits) on AVX2; wider codes (7, 8 bits) gather it.
    """
    off = offs[c]
    wi = (off >> 5) - w0
    if bits == 4 or bits == 2:  # such codes never straddle a word: one word, one shift
        words = ushr(vload(wb, wi * width + k), off & 31)
    else:
        words = vfunnel(vload(wb, wi * width + k), vload(wb, (wi + 1) * width + k), off & 31)
    row = lut.shape[1]
    code_bits = offs[c + 1] - off if bits == 0 else bits
    if bits == 0 and code_bits > 6:  # 7 or 8 bits (tests' stores): a gather from the row
        return vindex(lut, c * row, uand(words, row - 1), LANES)
    if bits == 0 and code_bits > 4:  # a 5-bit code's levels repeat every 32 entries: bit 5 picks alike
        base = c * row
        low = vpick(vlookup(vload(lut, base), words), vlookup(vload(lut, base + LANES), words), words, LANES)
        if code_bits == 5:
            return low
        high = vpick(vlookup(vload(lut, base + 2 * LANES), words), vlookup(vload(lut, base + 3 * LANES), words),
                     words, LANES)
        return vpick(low, high, words, 2 * LANES)
    if code_bits <= 3:  # the row's first 8 entries hold every level: half the permutes on AVX2
        return vlookup8(vload(lut, c * row), words)
    return vlookup(vload(lut, c * row), words)


@njit(cache=True, inline="always")
def code_at(codes, first, off, bits):
    """The code of `bits` bits at stream bit `off` of the slot whose words start at element `first` of the flat
    uint32 codes."""
    wi = first + (off >> 5)
    sh = off & 31
    v = np.int64(codes[wi]) >> sh
    if sh + bits > 32:
        v |= np.int64(codes[wi + 1]) << (32 - sh)
    return v & ((1 << bits) - 1)
