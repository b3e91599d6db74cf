"""GPU backend of `decode_attention`, in Triton: the packed codes are read in place, never dequantized into memory.

Passes over one layer (KVQuant, Hooper et al., arXiv 2401.18079, Section 3.7), each one Triton program grid:

1. keys (`passes.key_scores`): a program takes BLOCK_T tokens of one row and one KV head, unpacks each
   channel's codes, dequantizes them by that channel's lookup table LUT[c] = level * scale[c] + zero[c],
   turns them by RoPE at each token's position in registers and dots them with all G query heads of the
   GQA group, so a head's codes are read once for its G query heads; raw scores go to a [B, Hq, T] buffer;
2. key outliers (`key_outliers`, CSC): a fixed number of non-zeros per program, whichever tokens they fall in
   (load balanced: a burst of outliers in a few tokens spreads over many programs); each adds
   q . RoPE(exact - dequantized) to its token's score with an atomic add;
3. sinks (`sink_scores`): their scores are recomputed from the exact fp16 keys;
4. values, split over the sequence as flash decoding does (`value_partial`): each program takes a range of
   tokens of one row and KV head, scales, caps and masks their scores, keeps a running maximum and sum and
   accumulates softmax weight times value, each value dequantized from its codes and its slot's scale and
   zero-point (a sink's slot reads its exact value); `combine` joins the splits (and a learned sink logit);
5. value outliers (`value_outliers`, CSR, equal non-zeros per program) add p_t (exact - dequantized).

Splits are sized so that rows x KV heads x splits fill the GPU at batch 1 and long contexts. Under Triton's
interpreter (`TRITON_INTERPRET=1`) the same programs run on CPU tensors, which is how the tests hold them
to the reference backend on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from torch.utils.weak import WeakIdKeyDictionary

from ...numerics.rope import Rope
from ..view import ARRAYS, Outliers, StoreView
from . import passes

BLOCK_T = 64  # tokens a key / value program takes at a time
SPARSE_BLOCK = 128  # outlier entries per sparse program
DOT_MIN = 16  # the smallest side of a tile tl.dot takes: query heads and channels are padded to it
# The key and value products run on the matrix units in three tf32 passes, which keep float32's accuracy (one
# tf32 pass rounds operands to 10 bits of mantissa, about 1e-3, past what the check against the reference allows)
DOT_PRECISION = "tf32x3"
INTERPRETED_BLOCK_T, INTERPRETED_SPARSE_BLOCK = 128, 1024  # the interpreter pays per program: fewer, larger
_TABLES: dict[tuple, tuple[int, tuple[torch.Tensor, ...]]] = {}  # (frequencies, scaling, device) -> tables
_RANGES = WeakIdKeyDictionary()  # positions array -> (its version, tokens, min, max)
_CHECKED: set[tuple] = set()  # compiled variants whose first result on this device matched the reference
CHECK_ATOL, CHECK_RTOL = 5e-5, 1e-4


def _variant(q: torch.Tensor, kv: StoreView, rope: Rope, key_mask, softcap, sink_logits) -> tuple:
    """What selects a compiled variant of the programs (their constexpr arguments) on one device."""
    k_out, v_out = kv.k_outliers, kv.v_outliers
    return (str(q.device), kv.k_bits, kv.v_bits, kv.k_offsets is not None, kv.v_offsets is not None, q.shape[-1], q.shape[1] // kv.heads, rope.half,
            kv.sink_slot.shape[1], k_out is not None and k_out.fixed, v_out is not None and v_out.fixed,
            key_mask is not None, bool(softcap), sink_logits is not None)


def _check_first(out: torch.Tensor, args: tuple, variant: tuple) -> None:
    """The first result of each compiled variant on a GPU is held to the reference backend: a device or
    compiler on which the programs compute something else raises instead of decoding with wrong numbers."""
    from ..reference import decode_attention as reference

    want = reference(*args)
    # a row whose keys are all masked is NaN in both (a softmax over nothing): equal, not a kernel error
    if not torch.allclose(out, want, atol=CHECK_ATOL, rtol=CHECK_RTOL, equal_nan=True):
        err = float((out - want).nan_to_num(float("inf")).abs().max())
        raise RuntimeError(f"the triton decode kernels differ from the reference by {err:.3g} on {out.device} "
                           f"(variant {variant}): decode with backend='reference' or the CPU, and report it")
    _CHECKED.add(variant)


def interpreting() -> bool:
    """True when Triton's interpreter runs the programs (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _dot(n: int) -> int:
    """A power of two of at least 16: a side of the tiles `tl.dot` multiplies (the rows past n are masked)."""
    return max(DOT_MIN, _p2(n))


def _tables(rope: Rope, max_position: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos_hi, sin_hi [rows, R/2] at hi = row * 64 (scaling folded in) and cos_lo, sin_lo [64, R/2] at lo < 64,
    float32 on `device`; angles in float64, rounded once, as `Rope.cos_sin`. Rows grow by doubling."""
    key = (*rope.key, str(device))
    rows_needed = max_position // passes.LOW + 1
    have = _TABLES.get(key)
    if have is not None and have[0] >= rows_needed:
        return have[1]
    rows = 1 << (rows_needed - 1).bit_length()
    freq = rope.inv_freq.double()
    hi = torch.arange(rows, dtype=torch.float64)[:, None] * passes.LOW * freq[None, :]
    lo = torch.arange(passes.LOW, dtype=torch.float64)[:, None] * freq[None, :]
    tabs = tuple(x.float().contiguous().to(device) for x in
                 (hi.cos() * rope.scaling, hi.sin() * rope.scaling, lo.cos(), lo.sin()))
    _TABLES[key] = (rows, tabs)
    return tabs


def _position_range(positions: torch.Tensor, tokens: int) -> tuple[int, int]:
    """Min and max of positions[:tokens], which size the RoPE tables: read once per state of the array, which the
    layers of a cache share, so that a decode step waits for the device once for them, not once per layer.
    Arrays made in inference mode keep no version to tell their states apart and are read every time."""
    version = None if positions.is_inference() else positions._version
    hit = _RANGES.get(positions)
    if hit is not None and version is not None and hit[:2] == (version, tokens):
        return hit[2:]
    lo, hi = torch.stack(torch.aminmax(positions[:tokens])).tolist()
    if version is not None:
        _RANGES[positions] = (version, tokens, lo, hi)
    return lo, hi


def _splits(tokens: int, programs: int, device: torch.device, block_t: int) -> int:
    """Tokens per split: a multiple of BLOCK_T, enough splits that the programs fill the device."""
    if device.type == "cuda":
        want = 2 * _multiprocessors(device.index or 0)
    else:
        want = 2  # the interpreter: the split-and-combine path, kept cheap
    per = triton.cdiv(tokens, max(1, want // max(1, programs)))
    return max(block_t, triton.cdiv(per, block_t) * block_t)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _entries_in_use(sparse: Outliers, slots: int) -> int:
    """Entries the sparse passes walk: every slot's fixed count (in pages, wherever the slots lie), or nnz."""
    return slots * int(sparse.fixed) if sparse.fixed is not None else int(sparse.nnz)


def _pointers(sparse: Outliers, slots: int) -> tuple[torch.Tensor | None, int, int]:
    """(pointers or None, fixed count or 0, binary-search steps) of one sparse array."""
    if sparse.fixed is not None:
        return None, int(sparse.fixed), 0
    if sparse.pointers is None:
        raise ValueError("outliers without row pointers must say how many entries every slot holds (fixed)")
    return sparse.pointers, 0, max(1, slots.bit_length())


def _widths(bits: int, offsets: torch.Tensor | None, device: torch.device) -> tuple[int, torch.Tensor]:
    """(BITS, offsets) of keys or values for the programs: one width (the offsets are not read), or 0 and the
    store's own int32 offsets of each channel's first stream bit (`packing.code_offsets`)."""
    if offsets is None:
        return bits, _unread(str(device))
    return 0, offsets.to(device)


@functools.cache
def _unread(device: str) -> torch.Tensor:
    """A stand-in for the offsets programs of one width never read."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _check_sizes(q: torch.Tensor, kv: StoreView) -> None:
    bsz, hq, _ = q.shape
    t = kv.tokens
    if bsz * hq * t >= 1 << 31:
        raise ValueError(f"{bsz} rows x {hq} query heads x {t} tokens is 2**31 scores or more, past what the "
                         "triton backend addresses in one call; use backend='reference' or a shorter cache")


def _bases(kv: StoreView) -> list[torch.Tensor]:
    """Per array of `view.ARRAYS`, the element where each slot n = t * B + b's data starts, int64 [T * B]: n
    times the slot's width in token-major arrays (outliers: in those of a fixed count), or its place in its
    page (`Rows.elements`), which the programs read in place."""
    t, b = kv.tokens, kv.batch
    if kv.rows is not None:
        return [kv.rows.starts(f, t) for f in range(len(ARRAYS))]
    n = torch.arange(t * b, dtype=torch.int64, device=kv.device)
    fk = kv.k_outliers.fixed if kv.k_outliers is not None and kv.k_outliers.fixed else 0
    fv = kv.v_outliers.fixed if kv.v_outliers is not None and kv.v_outliers.fixed else 0
    return [n * kv.k_codes.shape[-1], n * kv.v_codes.shape[-1], n * 2, n * fk, n * fk, n * fv, n * fv]


def decode_attention(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None, softcap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """See `kvsqueeze.kernels.decode_attention`; q float32 [B, Hq, D] on a CUDA device (or on the CPU under
    Triton's interpreter) -> float32 [B, Hq, D]. The first call of each compiled variant on a GPU is checked
    against the reference backend. A view of physical rows (a paged cache) is read in place, through its rows."""
    out = _decode(q, kv, rope, scaling, key_mask, softcap, sink_logits)
    if q.device.type == "cuda" or os.environ.get("KVSQUEEZE_CHECK_TRITON") == "1":
        variant = _variant(q, kv, rope, key_mask, softcap, sink_logits)
        if variant not in _CHECKED:
            _check_first(out, (q, kv, rope, scaling, key_mask, softcap, sink_logits), variant)
    return out


def _decode(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float, key_mask: torch.Tensor | None,
            softcap: float | None, sink_logits: torch.Tensor | None) -> torch.Tensor:
    dev = q.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"the triton backend runs on CUDA tensors, got {dev}; use backend='auto'")
    _check_sizes(q, kv)
    bsz, hq, d = q.shape
    h, t = kv.heads, kv.tokens
    g = hq // h
    slots = t * bsz
    half = rope.half
    rest = d - 2 * half
    lo_pos, hi_pos = _position_range(kv.positions, t)
    if lo_pos < 0:
        raise ValueError(f"RoPE positions must be >= 0, got {lo_pos}")
    cos_hi, sin_hi, cos_lo, sin_lo = _tables(rope, hi_pos, dev)
    levels_k = kv.k_levels.to(dev, torch.float32)  # [L], or [C, L] where channels have widths of their own
    klut = ((levels_k if levels_k.dim() == 2 else levels_k[None, :]) * kv.k_scale.float()[:, None]
            + kv.k_zero.float()[:, None]).contiguous()  # [C, L]
    vlut = kv.v_levels.to(dev, torch.float32).contiguous()
    vrow = vlut.shape[1] if vlut.dim() == 2 else 0  # a table per channel, or one for all
    # BITS 0: each channel's own width, its first bit at offs[c] (int32 offsets on the device)
    k_bits, k_offs = _widths(kv.k_bits, kv.k_offsets, dev)
    v_bits, v_offs = _widths(kv.v_bits, kv.v_offsets, dev)
    k_codes, v_codes = kv.k_codes, kv.v_codes
    positions, sz = kv.positions, kv.v_scale_zero
    sinks = kv.sink_slot.shape[1]
    kbase, vbase, szbase, kcbase, kxbase, vcbase, vxbase = _bases(kv)
    block_t, sparse_block = BLOCK_T, SPARSE_BLOCK
    if interpreting():
        block_t, sparse_block = INTERPRETED_BLOCK_T, INTERPRETED_SPARSE_BLOCK
    shape = dict(D=d, G=g, G_P=_dot(g), HALF=half, HALF_P=_dot(half), PASS=rest, PASS_P=_dot(rest))

    scores = torch.empty(bsz, hq, t, dtype=torch.float32, device=dev)
    passes.key_scores[(bsz * h, triton.cdiv(t, block_t))](
        q, k_codes, k_offs, klut, positions, cos_hi, sin_hi, cos_lo, sin_lo, scores, kbase, t, bsz, h, hq,
        BITS=k_bits, KROW=klut.shape[1], BLOCK_T=block_t, PRECISION=DOT_PRECISION, **shape)
    k_out = kv.k_outliers
    k_nnz = 0 if k_out is None else _entries_in_use(k_out, slots)
    if k_nnz:
        ptr, fixed, steps = _pointers(k_out, slots)
        passes.key_outliers[(triton.cdiv(k_nnz, sparse_block),)](
            q, k_codes, k_offs, klut, positions, cos_hi, sin_hi, cos_lo, sin_lo, scores,
            k_out.values if ptr is None else ptr, k_out.channels, k_out.values, kbase, kcbase, kxbase,
            k_nnz, slots, t, bsz, hq,
            -1 if k_out.code is None else int(k_out.code),
            D=d, G=g, HALF=half, BITS=k_bits, KROW=klut.shape[1], FIXED=fixed, STEPS=steps, BLOCK=sparse_block)
    if sinks:
        passes.sink_scores[(bsz * h, sinks)](
            q, kv.sink_k, kv.sink_slot, positions, cos_hi, sin_hi, cos_lo, sin_lo, scores, t, bsz, h, hq,
            S=sinks, **shape)

    split_t = _splits(t, bsz * h, dev, block_t)
    nsplit = triton.cdiv(t, split_t)
    m_part = torch.empty(bsz * hq * nsplit, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(bsz * hq * nsplit, d, dtype=torch.float32, device=dev)
    mask = scores if key_mask is None else key_mask.to(dev).contiguous().view(torch.uint8)
    passes.value_partial[(bsz * h, nsplit)](
        scores, mask, v_codes, v_offs, vlut, sz, vbase, szbase, kv.sink_v, kv.sink_slot, m_part, l_part, acc_part,
        float(scaling), float(softcap or 1.0), t, bsz, h, hq, split_t, nsplit,
        S=sinks, D=d, D_P=_dot(d), G=g, G_P=_dot(g), BITS=v_bits, VROW=vrow, HAS_MASK=key_mask is not None,
        SOFTCAP=bool(softcap), BLOCK_T=block_t, PRECISION=DOT_PRECISION)
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=dev)
    stats = torch.empty(bsz * hq, 2, dtype=torch.float32, device=dev)
    has_sink_logit = sink_logits is not None
    logit = sink_logits.detach().to(dev, torch.float32).reshape(hq).contiguous() if has_sink_logit else stats
    passes.combine[(bsz * hq,)](m_part, l_part, acc_part, logit, out, stats, hq, nsplit,
                                D=d, D_P=_p2(d), NS_P=_p2(nsplit), HAS_SINK_LOGIT=has_sink_logit)
    v_out = kv.v_outliers
    v_nnz = 0 if v_out is None else _entries_in_use(v_out, slots)
    if v_nnz:
        ptr, fixed, steps = _pointers(v_out, slots)
        passes.value_outliers[(triton.cdiv(v_nnz, sparse_block),)](
            v_codes, v_offs, vlut, sz, vbase, szbase, kv.sink_slot, scores, stats, out,
            v_out.values if ptr is None else ptr, v_out.channels, v_out.values, vcbase, vxbase,
            v_nnz, slots, t, bsz, hq,
            -1 if v_out.code is None else int(v_out.code),
            S=sinks, D=d, G=g, BITS=v_bits, VROW=vrow, FIXED=fixed, STEPS=steps, BLOCK=sparse_block)
    return out
