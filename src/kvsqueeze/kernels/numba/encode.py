"""Quantize-and-pack of new tokens on the CPU, in one numba call per append: a decode step's token one slot after
the other (`encode_append`), a prompt's or a prefill chunk's slots in parallel (`encode_append_parallel`).

What `KVStore.append` does with torch ops for a token that is no sink (`quantizer.VectorQuantizer.encode`,
`packing.pack_codes` / `pack_mixed`, `sparse.TokenOutliers`), fused and written straight into the store's
arrays, as the Triton encoder does on the GPU (`kernels/triton/encode.py`):

* keys, per channel against the recipe's offline range: an element outside [lo, hi] is an outlier (its code
  becomes `OUTLIER_CODE`, its fp16 value is appended to the CSC arrays in channel order), every other one takes
  the nearest level of (x - zero) / scale in its channel's codebook;
* values, per token: the k largest and k smallest elements are the outliers (ties to the lower channel), the
  (k+1)-th of each side bounds the range, scale and zero-point are rounded to fp16 as `affine.choose_qparams`
  does, and the 2k outliers are written in channel order (the fixed-count CSR rows);
* codes go into each slot's bit stream at `offs[c]` (c * bits for one width; the running sum of the widths
  when each channel has its own), little-endian, as the packers write them;
* the fp16 window of recent tokens (`:rN`) takes each new token at its ring entry.

fp16 values are written as their bit patterns (numba has no float16): `_f16_bits` rounds to nearest, ties to
even, as torch's `.half()` does, subnormals and overflow included. The tests hold every array this writes to
the torch path, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_MIN_SCALE = np.float32(1e-6)  # affine._MIN_SCALE as float32
_HALF = np.float32(0.5)


@njit(cache=True, inline="always")
def _f16_round(x):
    """x (float32) rounded to the nearest fp16 value, ties to even, as a float64 (exact): inf past 65504."""
    v = np.float64(x)
    if v == 0.0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)  # |v| = |m| 2**e, 0.5 <= |m| < 1
    q = math.ldexp(1.0, e - 11) if e >= -13 else math.ldexp(1.0, -24)  # fp16's quantum at |v|
    r = np.rint(v / q) * q
    if abs(r) > 65504.0:
        return math.copysign(math.inf, v)
    return r


@njit(cache=True, inline="always")
def _f16_bits(x):
    """The fp16 bit pattern (as int16) of float32 x rounded as `_f16_round` does."""
    r = _f16_round(x)
    sign = 0x8000 if math.copysign(1.0, r) < 0 else 0
    a = abs(r)
    if a == 0.0:
        bits = sign
    elif math.isinf(a):
        bits = sign | 0x7C00
    elif math.isnan(a):
        bits = 0x7E00
    elif a >= 6.103515625e-05:  # 2**-14: normal
        m, e = math.frexp(a)  # a = m 2**e, m in [0.5, 1)
        bits = sign | ((e + 14) << 10) | (int(m * 2048.0) - 1024)
    else:
        bits = sign | int(a * 16777216.0)  # subnormal: a / 2**-24
    return np.int16(bits - 65536 if bits >= 32768 else bits)


@njit(cache=True, inline="always")
def _code(norm, mids, row, count):
    """How many of the `count` ascending midpoints mids[row, :count] lie strictly below `norm` (torch.bucketize):
    the nearest level's index."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) >> 1
        if mids[row, mid] < norm:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, inline="always")
def _put(words, n, offs, c, code):
    """OR `code` into slot n's stream at bit offs[c] (a code may straddle two uint32 words)."""
    off = offs[c]
    w = off >> 5
    s = off & 31
    words[n, w] |= np.uint32((code << s) & 0xFFFFFFFF)
    if s + (offs[c + 1] - off) > 32:
        words[n, w + 1] |= np.uint32(code >> (32 - s))


@njit(cache=True)
def encode_append(xk, xv, k_lo, k_hi, k_scale, k_zero, k_mids, k_count, k_offs, v_mids, v_count, v_offs,
                  k_words, v_words, v_sz, k_outliers, k_ptr, k_base, k_chan, k_val, v_side, v_chan, v_val):
    """Encode N slots (no sinks) into the store's arrays, one after the other; returns the key outliers written.

    xk, xv float32 [N, C]; k_lo, k_hi, k_scale, k_zero float32 [C] (scale and zero fp16-exact); *_mids float32
    [C, M] (each channel's codebook midpoints, its first *_count[c] in use); *_offs int64 [C + 1] stream bit
    offsets; k_words, v_words uint32 [N, W] (the new slots' rows, overwritten); v_sz int16 [N, 2] (fp16 bits of
    scale, zero). Key outliers (when `k_outliers`): k_ptr [N] gets the running count after each slot, from
    `k_base`; k_chan int16 and k_val int16 (fp16 bits) [>= N * C] get the entries. Value outliers (`v_side` per
    side): v_chan, v_val int16 [N * 2 * v_side].
    """
    taken = np.zeros(xk.shape[1], np.bool_)
    nnz = 0
    for n in range(xk.shape[0]):
        nnz += _encode_slot(n, nnz, taken, xk, xv, k_lo, k_hi, k_scale, k_zero, k_mids, k_count, k_offs, v_mids,
                            v_count, v_offs, k_words, v_words, v_sz, k_outliers, k_chan, k_val, v_side, v_chan, v_val)
        if k_outliers:
            k_ptr[n] = k_base + nnz
    return nnz


PARALLEL_SLOTS = 64  # from this many slots (a prompt, a prefill chunk) `encode_append_parallel` pays for its threads
_SLOT_BLOCK = 16  # slots per work item of the parallel encoder


@njit(parallel=True, cache=True)
def encode_append_parallel(xk, xv, k_lo, k_hi, k_scale, k_zero, k_mids, k_count, k_offs, v_mids, v_count, v_offs,
                           k_words, v_words, v_sz, k_outliers, k_ptr, k_base, k_chan, k_val, v_side, v_chan, v_val):
    """`encode_append` over the slots in parallel, the same arrays written: each slot's key outliers counted first
    (a comparison per element), their running count taken, then every slot encoded where its entries begin."""
    n_slots, c_all = xk.shape
    ends = np.zeros(n_slots, np.int64)
    if k_outliers:
        for n in prange(n_slots):
            count = 0
            for c in range(c_all):
                if _key_outlier(xk[n, c], k_lo, k_hi, c):
                    count += 1
            ends[n] = count
        for n in range(1, n_slots):
            ends[n] += ends[n - 1]
    for item in prange((n_slots + _SLOT_BLOCK - 1) // _SLOT_BLOCK):
        taken = np.zeros(c_all, np.bool_)
        for n in range(item * _SLOT_BLOCK, min(n_slots, (item + 1) * _SLOT_BLOCK)):
            first = ends[n - 1] if n > 0 else 0
            _encode_slot(n, first, taken, xk, xv, k_lo, k_hi, k_scale, k_zero, k_mids, k_count, k_offs, v_mids,
                         v_count, v_offs, k_words, v_words, v_sz, k_outliers, k_chan, k_val, v_side, v_chan, v_val)
            if k_outliers:
                k_ptr[n] = k_base + ends[n]
    return ends[n_slots - 1] if n_slots else 0


@njit(cache=True, inline="always")
def _key_outlier(x, k_lo, k_hi, c):
    """A key element outside its channel's calibrated range is kept exact (the one test of both passes: the
    parallel encoder's counts must be the entries it writes)."""
    return x < k_lo[c] or x > k_hi[c]


@njit(cache=True, inline="always")
def _encode_slot(n, at, taken, xk, xv, k_lo, k_hi, k_scale, k_zero, k_mids, k_count, k_offs, v_mids, v_count,
                 v_offs, k_words, v_words, v_sz, k_outliers, k_chan, k_val, v_side, v_chan, v_val):
    """Slot n: its key codes and key outliers (written from entry `at`), its value codes, scale, zero-point and
    value outliers; returns how many key outliers it wrote. taken bool [C]: scratch."""
    c_all = xk.shape[1]
    nnz = at
    # keys
    for i in range(k_words.shape[1]):
        k_words[n, i] = 0
    for c in range(c_all):
        x = xk[n, c]
        if k_outliers and _key_outlier(x, k_lo, k_hi, c):
            k_chan[nnz] = np.int16(c - 65536 if c >= 32768 else c)
            k_val[nnz] = _f16_bits(x)
            nnz += 1
            continue  # OUTLIER_CODE is 0: nothing to OR in
        _put(k_words, n, k_offs, c, _code((x - k_zero[c]) / k_scale[c], k_mids, c, k_count[c]))
    # values: the v_side largest and smallest elements are exact, the next ones bound the range
    for c in range(c_all):
        taken[c] = False
    for _ in range(v_side):
        best = -1
        for c in range(c_all):
            if not taken[c] and (best < 0 or xv[n, c] > xv[n, best]):
                best = c
        taken[best] = True
    hi = -np.inf
    for c in range(c_all):
        if not taken[c] and xv[n, c] > hi:
            hi = xv[n, c]
    for _ in range(v_side):
        best = -1
        for c in range(c_all):
            if not taken[c] and (best < 0 or xv[n, c] < xv[n, best]):
                best = c
        taken[best] = True
    lo = np.inf
    for c in range(c_all):
        if not taken[c] and xv[n, c] < lo:
            lo = xv[n, c]
    hi32, lo32 = np.float32(hi), np.float32(lo)
    zero = np.float32(_f16_round(np.float32((hi32 + lo32) * _HALF)))
    half = np.float32((hi32 - lo32) * _HALF)
    scale = np.float32(_f16_round(half if half > _MIN_SCALE else _MIN_SCALE))
    if scale < _MIN_SCALE:
        scale = _MIN_SCALE
    v_sz[n, 0] = _f16_bits(scale)
    v_sz[n, 1] = _f16_bits(zero)
    for i in range(v_words.shape[1]):
        v_words[n, i] = 0
    e = n * 2 * v_side
    for c in range(c_all):
        x = xv[n, c]
        if taken[c]:
            v_chan[e] = np.int16(c - 65536 if c >= 32768 else c)
            v_val[e] = _f16_bits(x)
            e += 1
            continue
        _put(v_words, n, v_offs, c, _code((x - zero) / scale, v_mids, c, v_count[c]))
    return nnz - at


@njit(cache=True)
def write_window(keys, values, first, entries, taken, start, sink_k, sink_v, sink_slot):
    """The fp16 window's ring (`KVStore._take_window`, no padding, no sinks among the new tokens): token i of row b
    (keys, values float32 [B, T, C]) goes to entry first + (taken[b] + i) % entries of sink_k, sink_v (int16 fp16
    bits [B, S + W, C]) and sink_slot (its slot start + i), if it is among the row's last `entries`; taken[b]
    (int64 [B]) counts them."""
    b_all, t_all, c_all = keys.shape
    for b in range(b_all):
        total = taken[b] + t_all
        for i in range(t_all):
            rank = taken[b] + i
            if rank < total - entries:
                continue
            at = first + rank % entries
            for c in range(c_all):
                sink_k[b, at, c] = _f16_bits(keys[b, i, c])
                sink_v[b, at, c] = _f16_bits(values[b, i, c])
            sink_slot[b, at] = start + i
        taken[b] = total


@njit(cache=True)
def f16_bits(x):
    """fp16 bit patterns (int16) of float32 x [N] as `_f16_bits` writes them (for the tests)."""
    out = np.empty(x.shape[0], np.int16)
    for i in range(x.shape[0]):
        out[i] = _f16_bits(x[i])
    return out
