"""Fused CPU backend of `decode_attention`, compiled with numba.

Why numba rather than a C++ extension: it needs no compiler toolchain at install
time and the same pure-Python wheel runs everywhere, while LLVM still compiles
the loops for the machine at hand (`cache=True` keeps the machine code between
runs). `fastmath=False`: no reassociation, so every sum is added in the order
written here and results are reproducible; the vector work goes through
`simd.py` (16 float32 lanes across tokens, exact IEEE operations).

Passes over one layer (KVQuant, Hooper et al., arXiv 2401.18079, Section 3.7):

1. keys, one pass over the packed codes (`numba_keys.key_scores`): per block of
   64 tokens and KV head, each channel's codes are unpacked 16 tokens at a
   time, dequantized by a lookup in that channel's table LUT[c] = level *
   scale[c] + zero[c], rotated and dotted with every query head of the GQA
   group in registers: a head's codes are read once for all of its G query
   heads. RoPE at position p0 + u is split: the queries are turned back by the
   block's first position p0 once per block, the keys turned by u < 64 from
   fixed tables;
2. key outliers (CSC), a load-balanced sparse pass (`numba_sparse`): each
   worker takes a range of tokens holding an equal share of the non-zeros, not
   of the tokens; an outlier replaces its element before RoPE, so it adds
   q . RoPE(exact - dequantized);
3. sinks: their scores are recomputed from the exact fp16 keys;
4. masking and the maximum of each (row, query head) (`row_max`);
5. values, fused over the packed codes (`numba_values.value_sums`), with the
   softmax folded in: p_t = exp(score_t - max) is taken span by span as the
   weights are formed, and
   sum_t p_t (level[code] s_t + z_t) = sum_t (p_t s_t) level[code] + sum_t p_t z_t;
   value outliers (CSR, equal non-zeros per worker) and sinks add
   p_t (exact - stored); the sum is divided by sum_t p_t once, at the end.
   The cache keeps the same number of value outliers in every slot; that pass
   then runs 16 slots at a time in vector lanes (`value_outliers_fixed`).

All passes run inside one compiled call (`_attend`): one dispatch from Python,
and no multi-threaded torch op in between, so torch's thread pool and
numba's never wait on each other.
"""

from __future__ import annotations

import functools
import threading

import numba
import numpy as np
import torch
from numba import njit

from .api import CompressedKV, Outliers
from .numba_keys import key_scores, row_max, sink_scores
from .numba_sparse import key_outliers, value_outliers, value_outliers_fixed
from .numba_values import sink_values, value_sums
from .rope import BLOCK, Rope, RopeTables, build_tables
from .simd import LANES, vadd, vhsum, vload

_NO_BIAS = np.zeros((0, 0), np.float32)
_NO_OUTLIERS = (np.zeros(0, np.uint32), np.zeros(0, np.uint16), np.zeros(0, np.uint16), -1)
_TABLES: dict[tuple, RopeTables] = {}
_ROPES: dict[int, tuple] = {}  # id(rope) -> (rope, its frequencies' version, tables)
_LUTS: dict[tuple, tuple] = {}  # ids of a layer's quantizer tensors -> (the tensors, their versions, the tables)
_SCRATCH = threading.local()  # per thread: float32 buffers a call's scores and value scales live in


def _scratch(name: str, need: int) -> np.ndarray:
    """`need` float32 in a buffer kept between calls (grown by half again when too small): a fresh array of a
    megabyte per decode step would be mapped and page-faulted in anew every time."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < need:
        buf = np.empty(max(need, need * 3 // 2 if buf is not None else need), np.float32)
        setattr(_SCRATCH, name, buf)
    return buf[:need]


def _tables(rope: Rope, max_position: int) -> RopeTables:
    """RoPE tables for `rope`, cached per frequency set and grown by doubling; the same `Rope` object (with
    frequencies unchanged since) finds them without hashing its frequencies."""
    hit = _ROPES.get(id(rope))
    if hit is not None and hit[0] is rope and hit[1] == rope.inv_freq._version:
        tab = hit[2]
        if tab.max_position >= max_position:
            return tab
    key = (rope.inv_freq.numpy().tobytes(), rope.scaling)
    tab = _TABLES.get(key)
    if tab is None or tab.max_position < max_position:
        if len(_TABLES) > 16:
            _TABLES.clear()
        tab = _TABLES[key] = build_tables(rope, max_position)
    if len(_ROPES) > 64:
        _ROPES.clear()
    if not rope.inv_freq.is_inference():
        _ROPES[id(rope)] = (rope, rope.inv_freq._version, tab)
    return tab


def _np(x: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of x (a copy only where x is not contiguous)."""
    if x.requires_grad:
        x = x.detach()
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _half_bits(x: torch.Tensor) -> np.ndarray:
    """fp16 (or int16) tensor -> its 16-bit patterns, uint16 (numba has no float16; kernels read them with `f16`)."""
    return _np(x).view(np.uint16)


def _padded(table: torch.Tensor) -> np.ndarray:
    """[rows, 2**bits] -> [rows, 16] float32, the levels repeated: one vector per row, and entry
    (code + 2**bits * anything) == entry code, so a lookup may ignore the bits above the code."""
    return np.tile(_np(table.float()), (1, LANES // table.shape[1]))


def _luts(k_levels: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
          v_levels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The layer's key tables LUT[c] = level * scale[c] + zero[c] and its value table, built once per set of
    quantizer tensors (fixed for a layer) and rebuilt if one of them is modified in place. The entry holds the
    tensors, so their ids cannot be reused by other tensors while it lives."""
    src = (k_levels, k_scale, k_zero, v_levels)
    try:
        versions = (k_levels._version, k_scale._version, k_zero._version, v_levels._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: build every time
        return _build_luts(*src)
    key = (id(k_levels), id(k_scale), id(k_zero), id(v_levels))
    hit = _LUTS.get(key)
    if hit is None or hit[1] != versions:
        if len(_LUTS) > 1024:
            _LUTS.clear()
        hit = _LUTS[key] = (src, versions, *_build_luts(*src))
    return hit[2], hit[3]


def _build_luts(k_levels: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                v_levels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    klut = _padded(k_levels.float()[None, :] * k_scale.float()[:, None] + k_zero.float()[:, None])
    return klut, _padded(v_levels[None, :])


def _sparse(s: Outliers | None):
    """(pointers as uint32, channels as uint16, fp16 values as uint16 bits, the code under every outlier or -1),
    or None without outliers."""
    if s is None or s.nnz == 0:
        return None
    if s.nnz >= 1 << 32:
        raise ValueError(f"{s.nnz} outliers in one layer: the numba backend indexes at most 2**32 - 1")
    code = -1 if s.code is None else s.code
    return _np(s.pointers.to(torch.int32)).view(np.uint32), _half_bits(s.channels), _half_bits(s.values), code


def _fixed(s: Outliers | None, slots: int) -> int:
    """k when every one of the `slots` holds exactly k outliers (the vectorized value pass applies), else 0."""
    if s is None or not s.fixed or s.nnz != slots * s.fixed:
        return 0
    return s.fixed


@functools.cache
def _channel_maps(heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Head and offset in the head of every channel, uint32 [C] each (the sparse passes look them up)."""
    c = np.arange(heads * head_dim, dtype=np.uint32)
    return c // head_dim, c % head_dim


@njit(cache=True)
def _starts(tokens, per_row, threads):
    """Token ranges [items + 1] of the dense passes' work items (each covers every KV head of one row):
    enough items to keep every thread busy."""
    items = max(1, min(-(-8 * threads // per_row), -(-tokens // BLOCK)))
    out = np.empty(items + 1, np.int64)
    for i in range(items + 1):
        out[i] = tokens * i // items
    return out


@njit(cache=True)
def _position_range(positions):
    """(min, max) of int32 positions [T, B]."""
    flat = positions.reshape(-1)
    lo = hi = flat[0]
    for p in flat:
        lo, hi = min(lo, p), max(hi, p)
    return lo, hi


@njit(cache=True)
def _attend(q, k_codes, v_codes, klut, vlut, k_bits, v_bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo,
            scaling, k_ptr, k_chan, k_val, k_under, v_ptr, v_chan, v_val, v_under, v_fixed, chan_head,
            chan_pos, sink_k, sink_v, sink_slot, scale_zero, bias, threads, scores, sz):
    """All passes in order, one dispatch from Python; returns float32 [B, Hq, D]. Arguments: see the passes;
    k_under, v_under: the code under every key / value outlier (-1: codes vary); v_fixed: the value outliers per
    slot when every slot holds that many (0: counts vary); threads: numba's;
    scores float32 [B, Hq, T], sz float32 [2, B, T]: scratch space (their contents on entry do not matter)."""
    bsz, hq, d = q.shape
    starts = _starts(k_codes.shape[0], bsz, threads)
    key_scores(q, k_codes, klut, k_bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, starts, scores)
    if k_ptr.shape[0]:
        key_outliers(q, k_codes, klut, k_bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling,
                     k_ptr, k_chan, k_val, k_under, chan_head, chan_pos, 4 * threads, scores)
    has_sinks = (sink_slot >= 0).any()
    if has_sinks:
        sink_scores(q, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, sink_k, sink_slot, scores)
    m = np.empty((bsz, hq), np.float32)
    row_max(scores, bias, m)
    items = starts.shape[0] - 1
    partial = np.empty((bsz, heads, items, hq // heads, d), np.float32)
    psum = np.empty((bsz, heads, items, hq // heads), np.float32)
    value_sums(scores, m, v_codes, vlut, v_bits, heads, scale_zero, sz, starts, partial, psum)  # scores: exp
    out = np.zeros((bsz, hq, d), np.float32)
    total = np.zeros((bsz, hq), np.float32)
    for b in range(bsz):
        for h in range(heads):
            for i in range(items):  # work items in a fixed order
                out[b, h * (hq // heads):(h + 1) * (hq // heads)] += partial[b, h, i]
                total[b, h * (hq // heads):(h + 1) * (hq // heads)] += psum[b, h, i]
    if v_fixed > 0:
        lanes = np.zeros((threads, bsz, hq, d, LANES), np.float32)
        value_outliers_fixed(scores, v_codes, vlut, v_bits, heads, sz, v_fixed, v_chan, v_val, v_under, chan_head,
                             chan_pos, lanes)
        for b in range(bsz):  # parts added lane-wise, then the lanes, in a fixed order
            for hh in range(hq):
                for c in range(d):
                    v = vload(lanes[0, b, hh, c], 0)
                    for w in range(1, threads):
                        v = vadd(v, vload(lanes[w, b, hh, c], 0))
                    out[b, hh, c] += vhsum(v)
    elif v_ptr.shape[0]:
        parts = np.zeros((4 * threads, bsz, hq, d), np.float32)
        value_outliers(scores, v_codes, vlut, v_bits, heads, scale_zero, v_ptr, v_chan, v_val, v_under, chan_head,
                       chan_pos, parts)
        for w in range(4 * threads):
            out += parts[w]
    if has_sinks:
        sink_values(scores, v_codes, vlut, v_bits, heads, scale_zero, v_ptr, v_fixed, v_chan, v_val, sink_v, sink_slot,
                    out)
    for b in range(bsz):
        for hh in range(hq):
            out[b, hh] /= total[b, hh]
    return out


def decode_attention(q: torch.Tensor, kv: CompressedKV, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None) -> torch.Tensor:
    """See `kvsqueeze.kernels.decode_attention`; q float32 [B, Hq, D] on the CPU -> float32 [B, Hq, D]."""
    klut, vlut = _luts(kv.k_levels, kv.k_scale, kv.k_zero, kv.v_levels)
    return _run(_np(q), kv.heads, kv.k_bits, kv.v_bits, _np(kv.k_codes).view(np.uint32),
                _np(kv.v_codes).view(np.uint32), klut, vlut, _half_bits(kv.v_scale_zero), _np(kv.positions),
                _sparse(kv.k_outliers), _sparse(kv.v_outliers), _fixed(kv.v_outliers, kv.tokens * kv.batch),
                _half_bits(kv.sink_k), _half_bits(kv.sink_v), _np(kv.sink_slot), rope, scaling, key_mask)


def decode_store(q: torch.Tensor, store, positions, heads: int, head_dim: int, rope: Rope, scaling: float,
                 key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """See `kvsqueeze.kernels.decode_attention_store`: the store's buffers read as numpy views kept between calls
    (`GrowableTensor.array`), no `CompressedKV` built. Returns None where the general path must run instead
    (an input it would reject, with its error message; pointers wider than 32 bits)."""
    t, b = store.tokens, store.batch
    bsz, hq, d = q.shape
    k_out, v_out = store.k_outliers, store.v_outliers
    if (q.dtype != torch.float32 or d != head_dim or d % 2 or hq % heads or bsz != b or t == 0
            or heads * head_dim != store.channels or not _pointers_fit(k_out) or not _pointers_fit(v_out)):
        return None
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, t)):
        return None
    pos = positions.array() if hasattr(positions, "array") else _np(positions)
    if pos.ndim != 2 or pos.shape[0] < t or pos.shape[1] != b:
        return None
    klut, vlut = _luts(store.kq.levels, store.k_scale, store.k_zero, store.vq.levels)
    k_sparse = v_sparse = None
    if k_out is not None and k_out.nnz:
        k_sparse = (k_out.pointers.array(np.uint32), k_out.channels.array(np.uint16), k_out.values.array(np.uint16),
                    store.OUTLIER_CODE)
    v_fixed = 0
    if v_out is not None and v_out.nnz:
        v_fixed = v_out.fixed or 0  # a store's fixed-count rows hold exactly that many entries each
        ptr = _POINTERLESS if v_fixed else v_out.pointers.array(np.uint32)
        v_sparse = (ptr, v_out.channels.array(np.uint16), v_out.values.array(np.uint16), store.OUTLIER_CODE)
    sinks = _sink_arrays(store.sink_k, store.sink_v, store.sink_slot)
    return _run(_np(q), heads, store.k_bits, store.v_bits, store.k_codes.array(np.uint32),
                store.v_codes.array(np.uint32), klut, vlut, store.v_scale_zero.array(np.uint16), pos[:t],
                k_sparse, v_sparse, v_fixed, *sinks, rope, scaling, key_mask)


def _pointers_fit(sparse) -> bool:
    """Whether a store's `TokenOutliers` (or None) has no stored row pointers or int32 ones (else: general path)."""
    return sparse is None or sparse.fixed is not None or sparse.pointers.dtype == torch.int32


_POINTERLESS = np.zeros(0, np.uint32)  # fixed-count value outliers: no pass reads row pointers
_SINKS: dict[int, tuple] = {}  # id(sink_k) -> (the tensors, their numpy views)


def _sink_arrays(sink_k: torch.Tensor, sink_v: torch.Tensor, sink_slot: torch.Tensor) -> tuple:
    """16-bit and int32 numpy views of a store's sink tensors, kept while the store keeps the same tensors."""
    hit = _SINKS.get(id(sink_k))
    if hit is None or hit[0][0] is not sink_k or hit[0][1] is not sink_v or hit[0][2] is not sink_slot:
        if len(_SINKS) > 1024:
            _SINKS.clear()
        hit = _SINKS[id(sink_k)] = ((sink_k, sink_v, sink_slot),
                                    (_half_bits(sink_k), _half_bits(sink_v), _np(sink_slot)))
    return hit[1]


def _run(q, heads, k_bits, v_bits, k_codes, v_codes, klut, vlut, scale_zero, positions, k_sparse, v_sparse, v_fixed,
         sink_k, sink_v, sink_slot, rope, scaling, key_mask) -> torch.Tensor:
    """Both entry points end here: numpy inputs (sparse ones from `_sparse` or None) -> float32 [B, Hq, D]."""
    bsz, hq, d = q.shape
    t = k_codes.shape[0]
    if bsz * hq * t >= 1 << 31:  # vector lanes address the scores with 32-bit offsets
        raise ValueError(f"{bsz} rows x {hq} query heads x {t} tokens is 2**31 scores or more, past what the "
                         "numba backend addresses in one call; use backend='reference' or a shorter cache")
    lo, hi = _position_range(positions)
    if lo < 0:
        raise ValueError(f"RoPE positions must be >= 0, got {lo}")
    tab = _tables(rope, int(hi))
    bias = _NO_BIAS if key_mask is None else np.where(_np(key_mask), np.float32(0), np.float32(-np.inf))
    # work items are handed out one at a time: a thread that starts late (woken from sleep after other work,
    # such as torch's, ran on the machine) leaves its items to the others instead of holding up the pass
    chunk = numba.set_parallel_chunksize(1)
    try:
        out = _attend(q, k_codes, v_codes, klut, vlut, k_bits, v_bits, heads, positions, tab.cos_hi, tab.sin_hi,
                      tab.cos_lo, tab.sin_lo, np.float32(scaling), *(k_sparse or _NO_OUTLIERS),
                      *(v_sparse or _NO_OUTLIERS), v_fixed, *_channel_maps(heads, d), sink_k, sink_v, sink_slot,
                      scale_zero, bias, numba.get_num_threads(), _scratch("scores", bsz * hq * t).reshape(bsz, hq, t),
                      _scratch("sz", 2 * bsz * t).reshape(2, bsz, t))
    finally:
        numba.set_parallel_chunksize(chunk)
    return torch.from_numpy(out)
