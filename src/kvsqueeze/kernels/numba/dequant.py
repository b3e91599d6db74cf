"""The whole cache of one layer as float32 keys (pre-RoPE) and values, on the CPU: `dequantize_view`.

What `kernels.reference.dequantize_view` computes, element for element, in one compiled pass over the slots
instead of a dozen torch ops over [T, B, C] tensors: level[code] * scale + zero, each outlier in place of its
element, each sink's slot whole. A forward of several tokens over a compressed cache reads this (the question
of a long-context task over a 32K-token cache, a prefill chunk that attends to the chunks before it).

Every slot is one work item: its key codes through the layer's tables LUT[c] = level * scale[c] + zero[c]
(the decode kernel's, `attend._luts`), its value codes through the value levels times the slot's fp16 scale
plus its zero-point, multiplied and then added (two roundings, as torch's `levels[codes] * scale + zero`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ..view import NO_CHANNEL, Outliers, StoreView
from .attend import _even_offsets, _luts, _np
from .common import code_at
from .simd import f16

_NO_POINTERS = np.zeros(1, np.int64)


@njit(parallel=True, cache=True)
def dequantize_slots(k_codes, v_codes, klut, vlut, k_offs, v_offs, sz, k_ptr, k_chan, k_val, v_ptr, v_chan, v_val,
                     keys, values):
    """keys, values float32 [N, C] of the N slots: codes uint32 [N, W] packed along channels at stream bits
    offs int32 [C + 1]; klut / vlut float32 [C, R] (R >= 2**width of every channel); sz fp16 bits uint16 [N, 2];
    outliers: the entries of slot n are ptr[n] : ptr[n + 1] (int64 [N + 1]; [0]: none), channels uint16 (an entry
    at `NO_CHANNEL` is empty) and fp16 values as uint16 bits."""
    n, c = keys.shape
    k_out, v_out = k_ptr.shape[0] > 1, v_ptr.shape[0] > 1
    for s in prange(n):
        kw, vw = k_codes[s], v_codes[s]
        for j in range(c):
            keys[s, j] = klut[j, code_at(kw, 0, k_offs[j], k_offs[j + 1] - k_offs[j])]
        scale, zero = f16(sz[s, 0]), f16(sz[s, 1])
        for j in range(c):
            level = vlut[j, code_at(vw, 0, v_offs[j], v_offs[j + 1] - v_offs[j])]
            values[s, j] = level * scale + zero
        if k_out:
            for e in range(k_ptr[s], k_ptr[s + 1]):
                if k_chan[e] < c:  # NO_CHANNEL: an empty entry
                    keys[s, np.int64(k_chan[e])] = f16(k_val[e])
        if v_out:
            for e in range(v_ptr[s], v_ptr[s + 1]):
                if v_chan[e] < c:
                    values[s, np.int64(v_chan[e])] = f16(v_val[e])


@njit(cache=True)
def write_sinks(sink_k, sink_v, sink_slot, keys, values):
    """Each sink's exact key and value (fp16 bits [B, S, C]) over its slot t * B + b of keys, values [N, C]."""
    rows, sinks = sink_slot.shape
    for b in range(rows):
        for i in range(sinks):
            t = sink_slot[b, i]
            if t < 0:
                continue
            s = np.int64(t) * rows + b
            for j in range(keys.shape[1]):
                keys[s, j] = f16(sink_k[b, i, j])
                values[s, j] = f16(sink_v[b, i, j])


def _pointers(o: Outliers | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pointers int64, channels, fp16 values as uint16) of trimmed outliers (`Outliers.trim`)."""
    if o is None or o.nnz == 0:
        return _NO_POINTERS, np.zeros(0, np.uint16), np.zeros(0, np.uint16)
    return _np(o.pointers.long()), _np(o.channels).view(np.uint16), _np(o.values).view(np.uint16)


def _check_indices(kv: StoreView, t: int, c: int) -> None:
    """The compiled passes write where sinks and outliers point, unchecked: refuse indices past the arrays (kv
    trimmed)."""
    bad = []
    if kv.sink_slot.numel() and int(kv.sink_slot.max()) >= t:
        bad.append(f"a sink at token {int(kv.sink_slot.max())} of a {t}-token cache")
    for name, o in (("key", kv.k_outliers), ("value", kv.v_outliers)):
        channel = None if o is None or not o.nnz else o.channels.int() & 0xFFFF
        if channel is not None and int(channel.masked_fill(channel == NO_CHANNEL, 0).max()) >= c:
            bad.append(f"a {name} outlier past channel {c - 1}")
    if bad:
        raise ValueError(f"dequantize_view: {'; '.join(bad)}: the view does not describe this cache")


def dequantize_view(kv: StoreView) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (pre-RoPE) and values of every slot, float32 [T, B, C] each: `kernels.reference.dequantize_view`'s
    result, on CPU tensors."""
    luts = _luts(kv)  # the view's memo, before `trim` replaces it
    kv = kv.trim()
    t, b, c = kv.tokens, kv.batch, kv.channels
    slots = t * b
    keys = np.empty((slots, c), np.float32)
    values = np.empty((slots, c), np.float32)
    if slots:
        _check_indices(kv, t, c)
        k_offs = _even_offsets(kv.k_bits, c) if kv.k_offsets is None else _np(kv.k_offsets.int())
        v_offs = _even_offsets(kv.v_bits, c) if kv.v_offsets is None else _np(kv.v_offsets.int())
        dequantize_slots(_np(kv.k_codes).view(np.uint32).reshape(slots, -1),
                         _np(kv.v_codes).view(np.uint32).reshape(slots, -1), *luts, k_offs, v_offs,
                         _np(kv.v_scale_zero).view(np.uint16).reshape(slots, 2),
                         *_pointers(kv.k_outliers), *_pointers(kv.v_outliers), keys, values)
        write_sinks(_np(kv.sink_k).view(np.uint16), _np(kv.sink_v).view(np.uint16), _np(kv.sink_slot.int()), keys,
                    values)
    return torch.from_numpy(keys).view(t, b, c), torch.from_numpy(values).view(t, b, c)
