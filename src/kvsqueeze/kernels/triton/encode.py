"""Quantize-and-pack of new tokens on the GPU, in one Triton program per slot.

What `KVStore.append` does with torch ops (`quantizer.VectorQuantizer.encode`, `packing.pack_codes`), fused:

* keys, per channel against the recipe's offline range: an element outside [lo, hi] is an outlier (its code
  becomes `OUTLIER_CODE`), every other one takes the nearest level of (x - zero) / scale; the codes are packed
  into the slot's bit stream (groups of 32 codes in `bits` words);
* values, per token: the k largest and k smallest elements are the outliers (ties to the lower channel), the
  (k+1)-th of each side bounds the range, scale and zero-point are rounded to fp16 as `affine.choose_qparams`
  does, the codes are packed likewise, and the 2k outliers are written in channel order (the store's
  fixed-count CSR rows);
* sink slots keep zero codes and a zero scale and zero-point; their value-outlier row holds the first 2k
  channels exactly (what `TokenOutliers` pads such a row with).

The key outliers' count varies per token, so their mask goes back to the store, which compacts it into its CSC
arrays with torch. The tests hold every array this writes to the torch path, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.packing import GROUP_SIZE, OUTLIER_CODE, words_per_vector


@triton.jit
def _pack(codes, words_ptr, NG_P: tl.constexpr, NG, BITS: tl.constexpr):
    """Store codes [NG_P * 32] (int64, zero past the last channel) as NG groups of BITS int32 words."""
    grid = tl.reshape(codes, (NG_P, 32))
    i = tl.arange(0, 32)[None, :]
    off = i * BITS
    word = off >> 5
    shift = off & 31
    low = (grid << shift) & 0xFFFFFFFF
    high = tl.where(shift + BITS > 32, grid >> (32 - shift), 0)
    g = tl.arange(0, NG_P)
    for k in tl.static_range(BITS):
        w = tl.sum(tl.where(word == k, low, 0) + tl.where(word + 1 == k, high, 0), axis=1)
        w = tl.where(w >= 2147483648, w - 4294967296, w)  # the int32 bit pattern
        tl.store(words_ptr + g * BITS + k, w.to(tl.int32), mask=g < NG)


@triton.jit
def _nearest(norm, mids_ptr, L: tl.constexpr):
    """Index of the nearest level: how many midpoints lie strictly below (torch.bucketize)."""
    code = tl.zeros(norm.shape, dtype=tl.int64)
    for i in tl.static_range(L - 1):
        code += (tl.load(mids_ptr + i) < norm).to(tl.int64)
    return code


@triton.jit
def encode_slots(xk_ptr, xv_ptr, sink_ptr, k_lo, k_hi, k_scale, k_zero, k_mids, v_mids,
                 k_words, k_mask, v_words, v_sz, v_chan, v_val, C, WK, WV,
                 C_P: tl.constexpr, NG_P: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 K_OUTLIERS: tl.constexpr, V_SIDE: tl.constexpr, EXACT: tl.constexpr):
    n = tl.program_id(0)
    c = tl.arange(0, C_P)
    cm = c < C
    sink = tl.load(sink_ptr + n) != 0
    ng = (C + 31) // 32
    # keys: the offline per-channel range
    x = tl.load(xk_ptr + n * C + c, mask=cm, other=0.0)
    scale = tl.load(k_scale + c, mask=cm, other=1.0)
    zero = tl.load(k_zero + c, mask=cm, other=0.0)
    code = _nearest(tl.math.div_rn(x - zero, scale), k_mids, 1 << K_BITS)
    if K_OUTLIERS:
        out = cm & ((x < tl.load(k_lo + c, mask=cm, other=0.0)) | (x > tl.load(k_hi + c, mask=cm, other=0.0)))
        out = out & ~sink
        tl.store(k_mask + n * C + c, out.to(tl.int8), mask=cm)
        code = tl.where(out, EXACT, code)
    code = tl.where(cm & ~sink, code, EXACT)
    _pack(code, k_words + n * WK, NG_P, ng, K_BITS)
    # values: the token's own range between its V_SIDE largest and smallest elements
    x = tl.load(xv_ptr + n * C + c, mask=cm, other=0.0)
    taken = ~cm
    for _ in tl.static_range(V_SIDE):  # the largest still free, the lowest channel among equals
        top = tl.max(tl.where(taken, -float("inf"), x), axis=0)
        first = tl.min(tl.where(~taken & (x == top), c, C_P), axis=0)
        taken = taken | (c == first)
    hi = tl.max(tl.where(taken, -float("inf"), x), axis=0)
    low_taken = ~cm
    for _ in tl.static_range(V_SIDE):
        bottom = tl.min(tl.where(low_taken | taken, float("inf"), x), axis=0)
        first = tl.min(tl.where(~low_taken & ~taken & (x == bottom), c, C_P), axis=0)
        low_taken = low_taken | (c == first)
    lo = tl.min(tl.where(low_taken | (taken & cm), float("inf"), x), axis=0)
    outlier = cm & ((taken & cm) | (low_taken & cm))
    zero = ((hi + lo) * 0.5).to(tl.float16).to(tl.float32)
    scale = tl.maximum(tl.maximum((hi - lo) * 0.5, 1e-6).to(tl.float16).to(tl.float32), 1e-6)
    code = _nearest(tl.math.div_rn(x - zero, scale), v_mids, 1 << V_BITS)
    code = tl.where(cm & ~outlier & ~sink, code, EXACT)
    _pack(code, v_words + n * WV, NG_P, ng, V_BITS)
    tl.store(v_sz + n * 2, tl.where(sink, 0.0, scale).to(tl.float16))
    tl.store(v_sz + n * 2 + 1, tl.where(sink, 0.0, zero).to(tl.float16))
    if V_SIDE > 0:
        keep = tl.where(sink, cm & (c < 2 * V_SIDE), outlier)
        slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(v_chan + n * (2 * V_SIDE) + slot, c.to(tl.int16), mask=keep)
        tl.store(v_val + n * (2 * V_SIDE) + slot, x.to(tl.float16), mask=keep)


def encode(keys: torch.Tensor, values: torch.Tensor, sink: torch.Tensor, k_lo: torch.Tensor, k_hi: torch.Tensor,
           k_scale: torch.Tensor, k_zero: torch.Tensor, k_levels: torch.Tensor, v_levels: torch.Tensor,
           k_outliers: bool, v_side: int) -> dict[str, torch.Tensor]:
    """Encode N slots: keys, values float32 [N, C], sink bool [N]; the key range and fp16-exact qparams [C];
    codebooks [2**bits]; whether keys keep outliers; value outliers per side. Returns k_words [N, Wk] int32,
    k_mask bool [N, C] (None without key outliers), v_words [N, Wv] int32, v_sz fp16 [N, 2], v_chan int16 and
    v_val fp16 [N, 2 * v_side]."""
    n, c = keys.shape
    dev = keys.device
    kb, vb = int(k_levels.numel()).bit_length() - 1, int(v_levels.numel()).bit_length() - 1
    wk, wv = words_per_vector(c, kb), words_per_vector(c, vb)
    ng_p = triton.next_power_of_2(-(-c // GROUP_SIZE))
    f32 = lambda t: t.to(dev, torch.float32).contiguous()  # noqa: E731
    out = {"k_words": torch.empty(n, wk, dtype=torch.int32, device=dev),
           "k_mask": torch.zeros(n, c, dtype=torch.int8, device=dev) if k_outliers else None,
           "v_words": torch.empty(n, wv, dtype=torch.int32, device=dev),
           "v_sz": torch.empty(n, 2, dtype=torch.float16, device=dev),
           "v_chan": torch.empty(n, 2 * v_side, dtype=torch.int16, device=dev),
           "v_val": torch.empty(n, 2 * v_side, dtype=torch.float16, device=dev)}
    k_mids, v_mids = ((f32(lv)[1:] + f32(lv)[:-1]) * 0.5 for lv in (k_levels, v_levels))
    if n:
        placeholder = out["k_words"]
        encode_slots[(n,)](f32(keys), f32(values), sink.to(dev, torch.int8).contiguous(), f32(k_lo), f32(k_hi),
                           f32(k_scale), f32(k_zero), k_mids.contiguous(), v_mids.contiguous(), out["k_words"],
                           placeholder if out["k_mask"] is None else out["k_mask"], out["v_words"], out["v_sz"],
                           out["v_chan"] if v_side else placeholder, out["v_val"] if v_side else placeholder,
                           c, wk, wv, C_P=ng_p * GROUP_SIZE, NG_P=ng_p, K_BITS=kb, V_BITS=vb,
                           K_OUTLIERS=k_outliers, V_SIDE=v_side, EXACT=OUTLIER_CODE)
    if out["k_mask"] is not None:
        out["k_mask"] = out["k_mask"].bool()
    return out
