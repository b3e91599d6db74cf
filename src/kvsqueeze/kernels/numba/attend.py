"""Fused CPU backend of `decode_attention`, compiled with numba.

Why numba rather than a C++ extension: it needs no compiler toolchain at install
time and the same pure-Python wheel runs everywhere, while LLVM still compiles
the loops for the machine at hand (`cache=True` keeps the machine code between
runs). `fastmath=False`: no reassociation, so every sum is added in the order
written here and results are reproducible; the vector work goes through
`simd.py` (16 float32 lanes across tokens, exact IEEE operations).

Passes over one layer (KVQuant, Hooper et al., arXiv 2401.18079, Section 3.7):

1. keys, one pass over the packed codes (`keys.key_scores`): per block of
   64 tokens and KV head, each channel's codes are unpacked 16 tokens at a
   time, dequantized by a lookup in that channel's table LUT[c] = level *
   scale[c] + zero[c], rotated and dotted with every query head of the GQA
   group in registers: a head's codes are read once for all of its G query
   heads. RoPE at position p0 + u is split: the queries are turned back by the
   block's first position p0 once per block, the keys turned by u < 64 from
   fixed tables;
2. key outliers (CSC), a load-balanced sparse pass (`sparse.py`): each
   worker takes a range of tokens holding an equal share of the non-zeros, not
   of the tokens; an outlier replaces its element before RoPE, so it adds
   q . RoPE(exact - dequantized);
3. sinks: their scores are recomputed from the exact fp16 keys;
4. masking and the maximum of each (row, query head) (`row_max`);
5. values, fused over the packed codes (`values.value_sums`), with the
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
import operator
import threading
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import njit

from ...numerics.rope import Rope
from ..view import Outliers, StoreView
from .common import K_CHANNELS, K_CODES, K_VALUES
from .keys import key_scores, row_max, sink_scores
from .simd import LANES, vadd, vhsum, vload
from .sparse import key_outliers, value_outliers, value_outliers_fixed
from .tables import BLOCK, RopeTables, build_tables
from .values import sink_values, value_sums

_NO_BIAS = np.zeros((0, 0), np.float32)
_NO_SINK_LOGITS = np.zeros(0, np.float32)
_NO_OUTLIERS = (np.zeros(0, np.uint32), np.zeros(0, np.uint16), np.zeros(0, np.uint16), -1)
_POINTERLESS = np.zeros(0, np.uint32)  # fixed-count value outliers: no pass reads row pointers
_TABLES: dict[tuple, RopeTables] = {}  # (frequencies, scaling) -> RoPE tables, grown by doubling
_SCRATCH = threading.local()  # per thread: float32 buffers a call's scores and value scales live in


def decode_attention(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None, softcap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """See `kvsqueeze.kernels.decode_attention`; q float32 [B, Hq, D] on the CPU -> float32 [B, Hq, D]."""
    inputs = kernel_inputs(q, kv, rope, scaling, key_mask, softcap, sink_logits)
    # work items are handed out one at a time: a thread that starts late (woken from sleep after other work,
    # such as torch's, ran on the machine) leaves its items to the others instead of holding up the pass
    chunk = numba.set_parallel_chunksize(1)
    try:
        out = _attend(*inputs)
    finally:
        numba.set_parallel_chunksize(chunk)
    return torch.from_numpy(out)


class KernelInputs(NamedTuple):
    """Everything the passes read, as numpy arrays of the rows in use (16-bit floats as their uint16 bits).

    q float32 [B, Hq, D]; k_codes, v_codes uint32, flat; rows uint32 [B, >= T]: the slot of token t of batch row b
    (t * B + b for a store's token-major arrays, the page slot for a paged cache); geo int64 [7, 3] and shift:
    where a slot's data lies in each array (`common.at`); k_words uint32 [T * B]: the first key word of every
    slot (read where key outliers are); klut float32 [C, R] (LUT[c] = level * scale[c] +
    zero[c], repeated to R = 16 entries, 64 where channels of their own widths reach 5 or 6 bits); vlut float32
    [C, R] (channel c's levels, repeated); k_bits, v_bits: every
    channel's code width (0: channels have their own); k_offs, v_offs int32 [C + 1]: each channel's first bit in
    its slot's stream; positions int32 [T, B]; cos_hi .. sin_lo: the
    `tables.RopeTables`; k_ptr / v_ptr uint32 [slots + 1] (empty: none, or fixed counts), k_base uint32 [slots]: the
    first entry of each slot's key outlier channels, k_to_value: how much further its values are, k_chan / v_chan
    uint16
    [nnz], k_val / v_val fp16 bits [nnz]; k_under, v_under: the code under every outlier (-1: codes vary);
    v_fixed: value outliers per slot when every slot holds that many (0: counts vary); chan_head, chan_pos
    uint32 [C]: the head and offset of every channel; sink_k, sink_v fp16 bits [B, S, C], sink_slot int32 [B, S];
    scale_zero fp16 bits, flat; bias float32 [B, T] of 0 / -inf ([0, 0]: no mask); softcap: the logit cap
    (0: none); sink_logit float32 [Hq]: a learned logit per query head that joins the softmax without a value
    (empty: none); threads: numba's; scores float32 [B, Hq, T] and sz float32 [2, B, T]: scratch space.
    """

    q: np.ndarray
    k_codes: np.ndarray
    v_codes: np.ndarray
    rows: np.ndarray
    geo: np.ndarray
    shift: int
    k_words: np.ndarray
    klut: np.ndarray
    vlut: np.ndarray
    k_bits: int
    v_bits: int
    k_offs: np.ndarray
    v_offs: np.ndarray
    heads: int
    positions: np.ndarray
    cos_hi: np.ndarray
    sin_hi: np.ndarray
    cos_lo: np.ndarray
    sin_lo: np.ndarray
    scaling: np.float32
    k_ptr: np.ndarray
    k_base: np.ndarray
    k_to_value: int
    k_chan: np.ndarray
    k_val: np.ndarray
    k_under: int
    v_ptr: np.ndarray
    v_chan: np.ndarray
    v_val: np.ndarray
    v_under: int
    v_fixed: int
    chan_head: np.ndarray
    chan_pos: np.ndarray
    sink_k: np.ndarray
    sink_v: np.ndarray
    sink_slot: np.ndarray
    scale_zero: np.ndarray
    bias: np.ndarray
    softcap: np.float32
    sink_logit: np.ndarray
    threads: int
    scores: np.ndarray
    sz: np.ndarray


def kernel_inputs(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float,
                  key_mask: torch.Tensor | None, softcap: float | None = None,
                  sink_logits: torch.Tensor | None = None) -> KernelInputs:
    """The passes' inputs for one call (also what `benchmarks/decode_passes.py` times the passes on)."""
    t = kv.tokens
    bsz, hq, d = q.shape
    slots = t * bsz
    if bsz * hq * t >= 1 << 31:  # vector lanes address the scores with 32-bit offsets; refused before any copy
        raise ValueError(f"{bsz} rows x {hq} query heads x {t} tokens is 2**31 scores or more, past what the "
                         "numba backend addresses in one call; use backend='reference' or a shorter cache")
    a = _arrays(kv)
    if a.sink_slot.size and a.sink_slot.max() >= t:  # the sink passes write the score of that token: past the end
        raise ValueError(f"a sink names token {int(a.sink_slot.max())} of a cache of {t} tokens: sink_slot must be "
                         "below StoreView.tokens (-1: no sink)")
    klut, vlut = _luts(kv)
    positions = a.positions[:t]
    lo, hi = _position_range(positions)
    if lo < 0:
        raise ValueError(f"RoPE positions must be >= 0, got {lo}")
    tab = _tables(rope, int(hi))
    if kv.rows is None:  # token-major: slot n = t * B + b, its data at n * width of each array seen flat
        k_codes, v_codes, scale_zero = (x[:t].reshape(-1) for x in (a.k_codes, a.v_codes, a.scale_zero))
        v_fixed = _fixed(kv.v_outliers, slots)
        k_sparse = _sparse(kv.k_outliers, a.k_out, slots, False) or _NO_OUTLIERS
        v_sparse = _sparse(kv.v_outliers, a.v_out, slots, v_fixed > 0) or _NO_OUTLIERS
        wk, wv = a.k_codes.shape[2], a.v_codes.shape[2]
        geo = _token_major_geometry(wk, wv, v_fixed)
        rows, shift = _identity_rows(bsz, t), 0
        k_words = _identity_slots(slots) * np.uint32(wk) if k_sparse[1].size and k_sparse[3] < 0 else _POINTERLESS
        k_base, k_to_value = k_sparse[0][:slots], 0  # a slot's entries are where its pointer says
    else:
        k_codes, v_codes, scale_zero = a.k_codes, a.v_codes, a.scale_zero
        rows, geo, shift, k_words, k_sparse, k_base, k_to_value, v_sparse, v_fixed = _paged_inputs(kv, a, t)
    if max(k_codes.size, v_codes.size, scale_zero.size, k_sparse[1].size, v_sparse[1].size) >= 1 << 31:
        raise ValueError("a cache of 2**31 elements or more in one array: the numba backend addresses them with "
                         "32-bit offsets; use backend='reference' or a shorter cache")
    bias = _NO_BIAS if key_mask is None else np.where(_np(key_mask), np.float32(0), np.float32(-np.inf))
    k_bits, k_offs = _widths(kv.k_bits, kv.k_offsets, kv.channels, k_sparse[3] if k_sparse[1].size else 0)
    v_bits, v_offs = _widths(kv.v_bits, kv.v_offsets, kv.channels, v_sparse[3] if v_sparse[1].size else 0)
    k_ptr, k_chan, k_val, k_under = k_sparse
    return KernelInputs(_np(q), k_codes, v_codes, rows, geo, shift, k_words, klut, vlut, k_bits, v_bits, k_offs,
                        v_offs, kv.heads, positions,
                        tab.cos_hi, tab.sin_hi, tab.cos_lo, tab.sin_lo, np.float32(scaling), k_ptr, k_base, k_to_value,
                        k_chan, k_val, k_under, *v_sparse,
                        v_fixed, *_channel_maps(kv.heads, d), a.sink_k, a.sink_v, a.sink_slot, scale_zero,
                        bias, np.float32(softcap or 0.0), _NO_SINK_LOGITS if sink_logits is None else
                        np.ascontiguousarray(sink_logits.detach().float().cpu().numpy().reshape(hq)),
                        numba.get_num_threads(), _scratch("scores", bsz * hq * t).reshape(bsz, hq, t),
                        _scratch("sz", 2 * bsz * t).reshape(2, bsz, t))


@functools.cache
def _token_major_geometry(wk: int, wv: int, v_fixed: int) -> np.ndarray:
    """`geo` of a store's token-major arrays: slot n's data at n * width of each (page = width, shift 0)."""
    widths = (wk, wv, 2, 0, 0, v_fixed, v_fixed)  # key outliers go by pointers there
    return np.array([(w, w, 0) for w in widths], np.int64)  # writable, as a paged view's: one compiled variant


_ROWS: dict[tuple[int, int], np.ndarray] = {}  # (B, capacity) -> uint32 [B, capacity], rows[b, t] = t * B + b
_SLOTS: list[np.ndarray] = [np.zeros(0, np.uint32)]  # uint32 0, 1, 2, ..., grown by doubling


def _identity_rows(batch: int, t: int) -> np.ndarray:
    """The slots of a token-major store: rows[b, t] = t * B + b, uint32 [B, >= t] (kept, grown by doubling)."""
    cap = 1 << max(t - 1, 1).bit_length()
    hit = _ROWS.get((batch, cap))
    if hit is None:
        if len(_ROWS) > 16:
            _ROWS.clear()
        hit = _ROWS[(batch, cap)] = (np.arange(cap, dtype=np.uint32)[None, :] * np.uint32(batch)
                                     + np.arange(batch, dtype=np.uint32)[:, None])
    return hit


def _identity_slots(slots: int) -> np.ndarray:
    if _SLOTS[0].size < slots:
        _SLOTS[0] = np.arange(1 << max(slots - 1, 1).bit_length(), dtype=np.uint32)
    return _SLOTS[0][:slots]


def _paged_inputs(kv: StoreView, a: "_Arrays", t: int):
    """(rows, geo, shift, k_words, key outliers, their entry bases, to_value, value outliers, value outliers per
    slot) of a view into paged storage (`StoreView.rows`): outliers there are a fixed count per slot."""
    from ..view import ARRAYS

    r = kv.rows
    slots = r.slots
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[1] < t or not slots.is_contiguous():
        raise ValueError(f"rows.slots must be a contiguous int32 [B, >= {t}] tensor, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if not (len(r.page) == len(r.width) == len(r.offset) == len(ARRAYS)) or not 0 <= r.shift < 31:
        raise ValueError(f"rows: page, width and offset must give one entry per array of {ARRAYS}, and shift a "
                         f"power of two's exponent, got {r}")
    geo = np.array(list(zip(r.page, r.width, r.offset)), np.int64)
    rows = slots.numpy().view(np.uint32)
    first = lambda f: r.starts(f, t).numpy().astype(np.uint32)  # noqa: E731  each slot's first element
    k, v = kv.k_outliers, kv.v_outliers
    for o in (k, v):
        if o is not None and (not o.fixed or o.pointers is not None):
            raise ValueError("a view into pages holds a fixed count of outliers per slot (`Outliers.fixed`, no "
                             "pointers)")
    k_sparse, k_base, k_words, to_value = _NO_OUTLIERS, _POINTERLESS, _POINTERLESS, 0
    if k is not None:
        pointers = np.arange(t * slots.shape[0] + 1, dtype=np.uint32) * np.uint32(k.fixed)
        k_sparse = (pointers, a.k_out[1], a.k_out[2], -1 if k.code is None else k.code)
        k_base, to_value = first(K_CHANNELS), int(geo[K_VALUES, 2] - geo[K_CHANNELS, 2])
        if k.code is None:
            k_words = first(K_CODES)
    v_sparse, v_fixed = _NO_OUTLIERS, 0
    if v is not None:
        v_sparse, v_fixed = (_POINTERLESS, a.v_out[1], a.v_out[2], -1 if v.code is None else v.code), v.fixed
    return rows, geo, r.shift, k_words, k_sparse, k_base, to_value, v_sparse, v_fixed


class _Arrays(NamedTuple):
    """numpy views of a `StoreView`'s allocations, as the kernels read them (16-bit floats as uint16 bits)."""

    k_codes: np.ndarray  # uint32 [>= T, B, W], or flat (a view into pages)
    v_codes: np.ndarray
    scale_zero: np.ndarray  # uint16 [>= T, B, 2], or flat (a view into pages)
    positions: np.ndarray  # int32 [>= T, B]
    sink_k: np.ndarray  # uint16 [B, S, C]
    sink_v: np.ndarray
    sink_slot: np.ndarray  # int32 [B, S]
    k_out: tuple | None  # (pointers uint32 or None, channels uint16, values uint16) over the allocations
    v_out: tuple | None


def _sources(kv: StoreView) -> tuple:
    """The view's allocations: the same tensors at every step of a store (between reallocations) or of a layer's
    pages, while its positions and sinks are a step's own (a paged view's, a window's)."""
    out = [kv.k_codes, kv.v_codes, kv.v_scale_zero]
    for s in (kv.k_outliers, kv.v_outliers):
        out += [None, None, None] if s is None else [s.pointers, s.channels, s.values]
    return tuple(out)


def _bits16(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16)  # numba has no float16: kernels read the bits with `f16`


def _arrays(kv: StoreView) -> _Arrays:
    """The view's arrays in numpy; those of its allocations kept in its memo while the view holds the same
    tensors (a store's views do between reallocations, a layer's paged views while its pages stay): a decode step
    then converts only its positions and sinks."""
    src = _sources(kv)
    memo = kv.memo if kv.memo is not None else {}
    hit = memo.get("numba")
    if hit is None or len(hit[0]) != len(src) or not all(map(operator.is_, hit[0], src)):
        views = [_np(x) if x is not None else None for x in src]

        def sparse(i: int):
            if src[i + 1] is None:
                return None
            ptr = views[i]
            if ptr is not None:  # int64 pointers (2**31 entries or more) are converted on each call instead
                ptr = ptr.view(np.uint32) if ptr.dtype == np.int32 else None
            return ptr, _bits16(views[i + 1]), _bits16(views[i + 2])

        hit = (src, views[0].view(np.uint32), views[1].view(np.uint32), _bits16(views[2]), sparse(3), sparse(6))
        if all(x is None or x.is_contiguous() for x in src):  # else some array is a copy: convert again next time
            memo["numba"] = hit
    _, k_codes, v_codes, scale_zero, k_out, v_out = hit
    return _Arrays(k_codes, v_codes, scale_zero, _np(kv.positions), _bits16(_np(kv.sink_k)),
                   _bits16(_np(kv.sink_v)), _np(kv.sink_slot), k_out, v_out)


def _sparse(s: Outliers | None, arrays: tuple | None, slots: int, fixed: bool):
    """(pointers uint32, channels uint16, fp16 values as uint16 bits, the code under every outlier or -1) of
    the entries in use, or None without outliers; fixed-count value outliers need no pointers."""
    if s is None or s.nnz == 0:
        return None
    if s.nnz >= 1 << 32:
        raise ValueError(f"{s.nnz} outliers in one layer: the numba backend indexes at most 2**32 - 1")
    ptr, chan, val = arrays
    if fixed:
        ptr = _POINTERLESS
    elif s.pointers is None:  # a fixed count the pass reads through pointers (key slots)
        if not s.fixed:
            raise ValueError("outliers without pointers must give their count per slot (`fixed`)")
        ptr = np.arange(slots + 1, dtype=np.uint32) * np.uint32(s.fixed)
    elif ptr is None:
        ptr = _np(s.pointers[: slots + 1].to(torch.int32)).view(np.uint32)
    else:
        ptr = ptr[: slots + 1]
    return ptr, chan[: s.nnz], val[: s.nnz], -1 if s.code is None else s.code


def _fixed(s: Outliers | None, slots: int) -> int:
    """k when every one of the `slots` holds exactly k outliers (the vectorized value pass applies), else 0."""
    if s is None or not s.fixed or s.nnz != slots * s.fixed:
        return 0
    return s.fixed


@functools.cache
def _even_offsets(bits: int, channels: int) -> np.ndarray:
    return np.arange(channels + 1, dtype=np.int32) * bits  # int32 and writable, as a store's own: one variant


def _widths(bits: int, offsets: torch.Tensor | None, channels: int, under: int) -> tuple[int, np.ndarray]:
    """(the `bits` the passes take, int32 offsets [C + 1]) of keys or values: channels of one width, or each of
    its own (bits 0). Codes under outliers must then be known (`Outliers.code`): those passes read no codes."""
    if offsets is None and bits <= 4:
        return bits, _even_offsets(bits, channels)
    if offsets is None:  # the one-width lookup reads 16 entries: wider codes take the path of per-channel widths
        offsets = _even_offsets(bits, channels)
    if under < 0:
        raise ValueError(f"{'codes wider than 4 bits' if bits > 4 else 'channels of their own widths'} need the code "
                         "under every outlier to be known (`Outliers.code`), as KVStore stores it")
    return 0, offsets if isinstance(offsets, np.ndarray) else _np(offsets)  # the store's own int32 offsets, viewed


def _luts(kv: StoreView) -> tuple[np.ndarray, np.ndarray]:
    """The layer's key tables LUT[c] = level * scale[c] + zero[c] and its value table, kept in the view's memo
    and rebuilt if a quantizer tensor is another one or was modified in place."""
    src = (kv.k_levels, kv.k_scale, kv.k_zero, kv.v_levels)
    try:
        versions = (src[0]._version, src[1]._version, src[2]._version, src[3]._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: build every time
        return _build_luts(*src)
    memo = kv.memo if kv.memo is not None else {}
    hit = memo.get("numba.luts")
    if hit is None or hit[1] != versions or not all(map(operator.is_, hit[0], src)):
        hit = memo["numba.luts"] = (src, versions, *_build_luts(*src))
    return hit[2], hit[3]


def _build_luts(k_levels: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                v_levels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    c = k_scale.numel()
    k_rows = k_levels.float() if k_levels.dim() == 2 else k_levels.float()[None, :]  # a codebook per channel or one
    klut = _padded(k_rows * k_scale.float()[:, None] + k_zero.float()[:, None])
    v_rows = v_levels.float() if v_levels.dim() == 2 else v_levels.float()[None, :].expand(c, -1)
    return klut, _padded(v_rows)


def _padded(table: torch.Tensor) -> np.ndarray:
    """[rows, 2**bits] -> [rows, max(16, 2**bits)] float32, the levels repeated: a row is at least one vector,
    and entry (code + 2**bits * anything) == entry code, so a lookup may ignore the bits above the code."""
    return np.tile(_np(table.float()), (1, max(1, LANES // table.shape[1])))


def _np(x: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of x (a copy only where x is not contiguous)."""
    if x.requires_grad:
        x = x.detach()
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _scratch(name: str, need: int) -> np.ndarray:
    """`need` float32 in a buffer kept between calls (grown by half again when too small): a fresh array of a
    megabyte per decode step would be mapped and page-faulted in anew every time."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < need:
        buf = np.empty(max(need, need * 3 // 2 if buf is not None else need), np.float32)
        setattr(_SCRATCH, name, buf)
    return buf[:need]


def _tables(rope: Rope, max_position: int) -> RopeTables:
    """RoPE tables for `rope`'s frequencies covering `max_position`, cached by value and grown by doubling."""
    key = rope.key
    tab = _TABLES.get(key)
    if tab is None or tab.max_position < max_position:
        if len(_TABLES) > 16:
            _TABLES.clear()
        tab = _TABLES[key] = build_tables(rope, max_position)
    return tab


@functools.cache
def _channel_maps(heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Head and offset in the head of every channel, uint32 [C] each (the sparse passes look them up)."""
    c = np.arange(heads * head_dim, dtype=np.uint32)
    return c // head_dim, c % head_dim


@njit(cache=True)
def work_ranges(tokens, per_row, threads):
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
def _attend(q, k_codes, v_codes, rows, geo, shift, k_words, klut, vlut, k_bits, v_bits, k_offs, v_offs, heads,
            positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, k_ptr, k_base, k_to_value, k_chan, k_val, k_under,
            v_ptr, v_chan, v_val, v_under, v_fixed, chan_head, chan_pos, sink_k, sink_v, sink_slot, scale_zero, bias,
            softcap, sink_logit, threads, scores, sz):
    """All passes in order, one dispatch from Python; returns float32 [B, Hq, D]. The arguments are the fields of
    `KernelInputs`, one by one: passed as one tuple, its arrays compile to code about a third slower."""
    bsz, hq, d = q.shape
    starts = work_ranges(positions.shape[0], bsz, threads)
    key_scores(q, k_codes, rows, geo, shift, klut, k_bits, k_offs, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo,
               scaling, starts, scores)
    if k_ptr.shape[0]:
        key_outliers(q, k_codes, k_words, klut, k_bits, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling,
                     k_ptr, k_base, k_to_value, k_chan, k_val, k_under, chan_head, chan_pos, 4 * threads, scores)
    has_sinks = (sink_slot >= 0).any()
    if has_sinks:
        sink_scores(q, heads, positions, cos_hi, sin_hi, cos_lo, sin_lo, scaling, sink_k, sink_slot, scores)
    m = np.empty((bsz, hq), np.float32)
    row_max(scores, bias, softcap, m)
    if sink_logit.shape[0]:  # a learned logit joins each query head's softmax: it may be the maximum
        for b in range(bsz):
            for hh in range(hq):
                m[b, hh] = max(m[b, hh], sink_logit[hh])
    items = starts.shape[0] - 1
    partial = np.empty((bsz, heads, items, hq // heads, d), np.float32)
    psum = np.empty((bsz, heads, items, hq // heads), np.float32)
    value_sums(scores, m, v_codes, rows, geo, shift, vlut, v_bits, v_offs, heads, scale_zero, sz, starts, partial,
               psum)  # scores: exp
    out = np.zeros((bsz, hq, d), np.float32)
    total = np.zeros((bsz, hq), np.float32)
    for b in range(bsz):
        for h in range(heads):
            for i in range(items):  # work items in a fixed order
                out[b, h * (hq // heads):(h + 1) * (hq // heads)] += partial[b, h, i]
                total[b, h * (hq // heads):(h + 1) * (hq // heads)] += psum[b, h, i]
    if v_fixed > 0:
        lanes = np.zeros((threads, bsz, hq, d, LANES), np.float32)
        value_outliers_fixed(scores, v_codes, rows, geo, shift, vlut, v_bits, heads, sz, v_fixed, v_chan, v_val,
                             v_under, chan_head, chan_pos, lanes)
        for b in range(bsz):  # parts added lane-wise, then the lanes, in a fixed order
            for hh in range(hq):
                for c in range(d):
                    v = vload(lanes[0, b, hh, c], 0)
                    for w in range(1, threads):
                        v = vadd(v, vload(lanes[w, b, hh, c], 0))
                    out[b, hh, c] += vhsum(v)
    elif v_ptr.shape[0]:
        parts = np.zeros((4 * threads, bsz, hq, d), np.float32)
        value_outliers(scores, v_codes, geo[1, 1], vlut, v_bits, heads, scale_zero, v_ptr, v_chan, v_val, v_under,
                       chan_head, chan_pos, parts)
        for w in range(4 * threads):
            out += parts[w]
    if has_sinks:
        sink_values(scores, v_codes, rows, geo, shift, vlut, v_offs, heads, scale_zero, v_ptr, v_fixed, v_chan, v_val,
                    sink_v, sink_slot, out)
    for b in range(bsz):
        for hh in range(hq):
            if sink_logit.shape[0]:
                total[b, hh] += np.exp(sink_logit[hh] - m[b, hh])
            out[b, hh] /= total[b, hh]
    return out
