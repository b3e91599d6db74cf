"""One layer's compressed K/V store: packed codes, CSC/CSR outliers, fp16 sinks (pure torch).

This is the storage half of KVQuant's cache (Hooper et al., arXiv 2401.18079):
keys are quantized per channel before RoPE with the recipe's offline scales,
zero-points, thresholds and codebook; values per token, with the scale,
zero-point and top-k outliers of each new token computed online. Encoding is
`quantizer.VectorQuantizer.encode`, decoding is `affine.dequantize` (through
`kernels.reference.dequantize_view`): the very functions of the simulated
path, so the store reproduces it exactly. On the CPU `kernels.dequantize_view`
runs numba's compiled version of that reconstruction, equal bit for bit.

Layout, token-major (a slot is one token of one batch row; slot n = t * B + b):

* `k_codes`, `v_codes` int32 [T, B, W]: each slot's C = kv_heads * head_dim
  codes packed along channels as one bit stream (`numerics/packing.py`, W =
  ceil(C / 32) * bits). With head_dim a multiple of 32, every head starts on a
  word boundary, so a per-head kernel can read its slice directly; otherwise
  only the token's last group is padded. Where channels have widths of their
  own (`nuq@AVG:chan`), each slot is one stream of codes back to back
  (`packing.pack_mixed`, `k_offsets` / `v_offsets` say where each starts) and
  every channel reads its own codebook (`k_levels` / `v_levels` [C, 2**bits]).
* `k_scale`, `k_zero` fp16 [C]: offline, per channel. `v_scale_zero` fp16
  [T, B, 2]: online, per slot.
* `k_outliers` / `v_outliers`: `TokenOutliers` over slots (CSC of K^T,
  CSR of V), exact fp16 values with 16-bit channel indices. An outlier
  replaces its element, and the code under it is always `OUTLIER_CODE`: a
  kernel knows the dequantized value it replaces from the scales alone, without
  reading the codes a second time.
* sinks: the first `sinks` *real* (non-padding) tokens of each row, fp16
  pre-RoPE keys and values [B, S, C] plus their slot [B, S] (int32, -1 empty).
  A sink keeps a slot in the dense grids (zero codes, zero scales, no outliers)
  so the grids stay rectangular; `component_bytes` reports those bytes apart.
* an fp16 window (`window` > 0, methods `:rN`): the last `window` real tokens of
  each row that are not sinks, fp16 copies in the same table after the sinks
  (entries S .. S + window - 1, a ring: a row's n-th such token goes to entry
  S + n % window). Their slots keep their codes and outliers, so a token
  leaving the window is simply overwritten in the table and read from its
  codes from then on; kernels read every table entry as they read a sink.
* positions: the RoPE position of every slot (`PositionLog`, int32 [T, B]),
  shared by the stores of all layers of one cache.

Everything grows by capacity doubling (`buffers.py`); crop and batch gathers
edit the arrays in place of rebuilding them from the model. `view()` is what
the decode kernels read (`kernels.StoreView`): the store's allocations and
how many of their rows are in use, nothing copied.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
import os
from typing import NamedTuple

import numpy as np
import torch

from ..numerics.affine import choose_qparams
from ..methods.budget import check_widths
from ..kernels.api import dequantize_view
from ..kernels.view import Outliers, StoreView
from ..numerics.packing import OUTLIER_CODE, code_offsets, mixed_words, pack_codes, pack_mixed, words_per_vector
from ..numerics.quantizer import VectorQuantizer
from .buffers import GrowableTensor
from .positions import PositionLog
from .sparse import TokenOutliers


class WindowCropError(RuntimeError):
    """A crop would leave part of a cache's fp16 window without the fp16 copies it needs."""


class WindowState(NamedTuple):
    """A store's sink and window tables at `tokens` tokens and `batch` rows (`KVStore.window_state`)."""

    tokens: int
    batch: int
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_slot: torch.Tensor
    sinks_taken: torch.Tensor
    window_taken: torch.Tensor


class KVStore:
    """Compressed keys (pre-RoPE) and values of one layer; see the module docstring.

    Args:
        k_quant: per-channel key quantizer (offline range, `axis="channel"`).
        v_quant: per-token value quantizer (`axis="token"`, no channel groups).
        channels: C = kv_heads * head_dim.
        sinks: leading real tokens of each row kept exactly in fp16.
        device: where every array lives.
        head_dim: D, the width of one KV head (default: C, one head).
        positions: the cache's `PositionLog`, shared by its layers (default: a log of this store's own).
        encoder: who quantizes and packs new tokens: "torch" (the quantizer's torch ops), "triton" (one fused
            Triton program per slot, `kernels.triton.encode`; on CPU tensors only under Triton's interpreter),
            "numba" (one numba call per append on the CPU, writing into the arrays in place,
            `kernels.numba.encode`; appends that take sinks or padding go through the torch ops) or "auto"
            (triton for a store on a CUDA device, numba on the CPU, torch where neither encodes the method).
            All write the same bits.
    """

    OUTLIER_CODE = OUTLIER_CODE  # the code stored under every outlier (and in sink slots)

    def __init__(self, k_quant: VectorQuantizer, v_quant: VectorQuantizer, channels: int, sinks: int = 0,
                 device: torch.device | str = "cpu", head_dim: int | None = None,
                 positions: PositionLog | None = None, encoder: str = "auto", window: int = 0):
        if k_quant.axis != "channel" or v_quant.axis != "token" or v_quant.group:
            raise ValueError("KVStore stores per-channel keys and per-token values (KVQuant's axes)")
        head_dim = head_dim or channels
        if channels % head_dim:
            raise ValueError(f"{channels} channels are not a whole number of heads of width {head_dim}")
        self.key_quantizer, self.value_quantizer = k_quant, v_quant
        self.channels, self.head_dim, self.heads = channels, head_dim, channels // head_dim
        self.sinks = sinks
        if window < 0:
            raise ValueError(f"the fp16 window must hold 0 or more tokens, got {window}")
        self.window = window
        self.device = torch.device(device)
        # a log of its own is edited with the store; a shared one by the cache that shares it, once for all layers
        self.owns_positions = positions is None
        self.positions = positions if positions is not None else PositionLog(self.device)
        self.k_bits, self.v_bits = k_quant.bits, v_quant.bits
        # channels with widths of their own (`nuq@AVG:chan`): one bit stream of every width, a codebook per channel
        for q in (k_quant, v_quant):
            if q.widths is not None:
                check_widths(q.widths.tolist(), "KVStore")
                if q.widths_problem(channels):
                    raise ValueError(f"KVStore: {q.widths_problem(channels)}")
        self.k_offsets, self.v_offsets = (None if q.widths is None else code_offsets(q.widths).to(self.device)
                                          for q in (k_quant, v_quant))
        self.k_levels, self.v_levels = (q.decode_levels.to(self.device) for q in (k_quant, v_quant))
        scale, zero = choose_qparams(k_quant.lo.view(1, -1), k_quant.hi.view(1, -1))  # fp16-exact float32 [1, C]
        self.k_scale, self.k_zero = scale.view(-1).half().to(self.device), zero.view(-1).half().to(self.device)
        if encoder not in ("auto", "torch", "triton", "numba"):
            raise ValueError(f"encoder must be 'auto', 'torch', 'triton' or 'numba', got {encoder!r}")
        if encoder == "auto":  # the same bits either way: a fused encoder where it runs, else the torch ops
            fused = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
            encoder = "triton" if fused else "numba" if self.device.type == "cpu" else "torch"
        if encoder in ("triton", "numba") and (k_quant.group or v_quant.scope != "vector" or k_quant.slots):
            encoder = "torch"  # per-matrix value thresholds, key slots: the torch path alone
        if encoder == "triton" and (self.k_offsets is not None or self.v_offsets is not None):
            encoder = "torch"  # channel widths: not in the Triton encoder
        if encoder == "numba" and self.device.type != "cpu":
            raise ValueError(f"the numba encoder writes CPU arrays (this store is on {self.device}); use "
                             "encoder='auto'")
        if encoder == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton encoder runs on CUDA tensors (this store is on {self.device}); use "
                             "encoder='auto' or 'torch'")
        self.encoder = encoder
        self.batch = 0
        self._allocations: tuple = ()  # what the last view held, and the memo its views share
        self._memo: dict = {}
        self._allocate(0)

    def _allocate(self, batch: int) -> None:
        c, dev = self.channels, self.device
        self.batch = batch
        self.k_codes = GrowableTensor((batch, self._words("k")), torch.int32, dev)
        self.v_codes = GrowableTensor((batch, self._words("v")), torch.int32, dev)
        self.v_scale_zero = GrowableTensor((batch, 2), torch.float16, dev)
        # methods without outliers store no sparse arrays at all (`storage.tensor_bytes` counts none then)
        # a key slot count (`:kslotsN`): that many exact elements every token, so no pointers either
        self.k_outliers = TokenOutliers(c, dev, fixed=self.key_quantizer.slots or None) \
            if self.key_quantizer.fraction > 0 else None
        # per-token top-k value outliers: the same count every token, so CSR row pointers are implicit
        self.v_fixed = self.value_quantizer.fixed_outliers(c)
        self.v_outliers = TokenOutliers(c, dev, fixed=self.v_fixed) if self.value_quantizer.fraction > 0 else None
        self.sink_k = torch.zeros(batch, self.sinks + self.window, c, dtype=torch.float16, device=dev)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.sink_slot = torch.full((batch, self.sinks + self.window), -1, dtype=torch.int32, device=dev)
        self.sinks_taken = torch.zeros(batch, dtype=torch.int64, device=dev)  # per row, dropped ones included
        self.window_taken = torch.zeros(batch, dtype=torch.int64, device=dev)  # per row: tokens the window took

    def __getstate__(self) -> dict:
        # a copy (copy.copy, deepcopy, pickle) builds its own view: numpy views kept in the memo would not share
        # the copied storage
        return {**self.__dict__, "_allocations": (), "_memo": {}}

    # ---- size ----------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Slots per row (sequence length, padding and sinks included)."""
        return len(self.k_codes)

    @property
    def sink_count(self) -> torch.Tensor:
        """Sinks stored per row, int64 [B]."""
        return (self.sink_slot[:, : self.sinks] >= 0).sum(dim=1)

    @property
    def window_count(self) -> torch.Tensor:
        """Tokens held in the fp16 window per row, int64 [B]."""
        return (self.sink_slot[:, self.sinks:] >= 0).sum(dim=1)

    # ---- writing -------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> None:
        """Quantize and append T tokens of every row.

        Args:
            keys: pre-RoPE keys [B, T, C] (the `k_proj` output), any float dtype.
            values: values [B, T, C].
            real: bool [B, T], False at padding tokens (they are stored like any
                token, since attention masks them, but never become sinks).
                None: every token is real.
            positions: the RoPE position of each token [B, T] (int); None: counted on from the tokens held.
        """
        b, t, c = keys.shape
        if self.batch == 0 and self.tokens == 0:
            self._allocate(b)
        if b != self.batch or c != self.channels:
            raise ValueError(f"appending [B={b}, C={c}] to a cache of batch {self.batch} and {self.channels} channels")
        # the numba encoder takes real tokens that are no sinks; on the CPU these reads cost nothing
        numba = self.encoder == "numba" and (real is None or bool(real.all()))
        pending = self.sinks - int(self.sinks_taken.min()) if numba and self.sinks else 0  # sinks still to take
        if 0 < pending < t and int(self.sinks_taken.max()) == self.sinks - pending:
            # a prompt's first tokens are its sinks: those through the torch ops, the rest in one numba call
            for lo, hi in ((0, pending), (pending, t)):
                self.append(keys[:, lo:hi], values[:, lo:hi], None, None if positions is None else positions[:, lo:hi])
            return
        start = self.tokens
        if positions is None:
            positions = torch.arange(start, start + t, device=keys.device).expand(b, t)
        self.positions.write(start, positions)
        if numba and pending <= 0:
            self._append_numba(keys, values, t, b)
            return
        sink = self._take_sinks(keys, values, real)  # [B, T]
        if self.window:
            self._take_window(keys, values, real, sink)
        xk = keys.transpose(0, 1).reshape(t * b, c).float()  # [T*B, C], slot order
        xv = values.transpose(0, 1).reshape(t * b, c).float()
        flat_sink = sink.t().reshape(-1, 1)  # [T*B, 1]
        if self.encoder == "triton":
            self._append_fused(xk, xv, flat_sink, t, b)
            return
        enc_k, enc_v = self.key_quantizer.encode(xk), self.value_quantizer.encode(xv)
        # codes never read back (under outliers, padding entries of fixed-count rows included, and in sink
        # slots) are OUTLIER_CODE
        k_replaced, v_replaced = flat_sink, flat_sink
        if self.k_outliers is not None:
            k_replaced = self._append_outliers(self.k_outliers, enc_k.outliers & ~flat_sink, xk, t) | flat_sink
        if self.v_outliers is not None:
            v_replaced = self._append_outliers(self.v_outliers, enc_v.outliers & ~flat_sink, xv, t) | flat_sink
        k_codes = enc_k.codes.masked_fill(k_replaced, self.OUTLIER_CODE)
        v_codes = enc_v.codes.masked_fill(v_replaced, self.OUTLIER_CODE)
        self.k_codes.append(self._pack(k_codes, "k").view(t, b, -1))
        self.v_codes.append(self._pack(v_codes, "v").view(t, b, -1))
        sz = torch.cat([enc_v.scale, enc_v.zero], dim=1).masked_fill(flat_sink, 0)  # [T*B, 2], fp16-exact
        self.v_scale_zero.append(sz.half().view(t, b, 2))

    @staticmethod
    def _append_outliers(sparse: TokenOutliers, mask: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
        # a decode step leaves room for every element instead of reading how many are outliers (`sparse.py`)
        return sparse.append_unsettled(mask, x) if t == 1 else sparse.append(mask, x)

    def _pack(self, codes: torch.Tensor, kv: str) -> torch.Tensor:
        """Pack the quantizer's codes (in range by construction: not read back) of keys ("k") or values ("v")."""
        offsets = self.k_offsets if kv == "k" else self.v_offsets
        if offsets is None:
            return pack_codes(codes, self.k_bits if kv == "k" else self.v_bits, check=False)
        return pack_mixed(codes, offsets, words=(self.k_codes if kv == "k" else self.v_codes).row_shape[-1])

    def _words(self, kv: str) -> int:
        """int32 words one slot's codes of keys ("k") or values ("v") take."""
        offsets = self.k_offsets if kv == "k" else self.v_offsets
        return words_per_vector(self.channels, self.k_bits if kv == "k" else self.v_bits) if offsets is None \
            else mixed_words(offsets)

    def _append_fused(self, xk: torch.Tensor, xv: torch.Tensor, flat_sink: torch.Tensor, t: int, b: int) -> None:
        """`append`'s encoding in one Triton program per slot (`kernels.triton.encode`); the same bits."""
        from ..kernels.triton.encode import encode

        kq, vq = self.key_quantizer, self.value_quantizer
        side = self.v_fixed // 2 if self.v_outliers is not None else 0
        enc = encode(xk, xv, flat_sink.view(-1), kq.lo, kq.hi, self.k_scale, self.k_zero, kq.levels, vq.levels,
                     self.k_outliers is not None, side)
        if self.k_outliers is not None:
            self._append_outliers(self.k_outliers, enc["k_mask"], xk, t)
        if self.v_outliers is not None:
            self.v_outliers.append_rows(enc["v_chan"], enc["v_val"])
        self.k_codes.append(enc["k_words"].view(t, b, -1))
        self.v_codes.append(enc["v_words"].view(t, b, -1))
        self.v_scale_zero.append(enc["v_sz"].view(t, b, 2))

    def _append_numba(self, keys: torch.Tensor, values: torch.Tensor, t: int, b: int) -> None:
        """`append`'s encoding of real tokens that are no sinks, in one numba call writing the arrays in place
        (`kernels.numba.encode`); the same bits as the torch ops."""
        from ..kernels.numba.encode import PARALLEL_SLOTS, encode_append, encode_append_parallel, write_window

        n, c, start = t * b, self.channels, self.tokens
        xk = keys.detach().float().transpose(0, 1).reshape(n, c).contiguous()  # [T*B, C], slot order
        xv = values.detach().float().transpose(0, 1).reshape(n, c).contiguous()
        if self.window:
            write_window(keys.detach().float().contiguous().numpy(), values.detach().float().contiguous().numpy(),
                         self.sinks, self.window, self.window_taken.numpy(), start,
                         self.sink_k.view(torch.int16).numpy(), self.sink_v.view(torch.int16).numpy(),
                         self.sink_slot.numpy())
        k_words = self.k_codes.extend_host(t).reshape(n, -1).view(np.uint32)
        v_words = self.v_codes.extend_host(t).reshape(n, -1).view(np.uint32)
        v_sz = self.v_scale_zero.extend_host(t).reshape(n, 2)  # fp16 bits
        ko, vo = self.k_outliers, self.v_outliers
        none16 = np.empty(0, np.int16)
        k_ptr, k_chan, k_val, k_base = ko.reserve(n, n * c) if ko is not None else (
            np.empty(0, np.int32), none16, none16, 0)
        side = self.v_fixed // 2 if vo is not None else 0
        _, v_chan, v_val, v_base = vo.reserve(n, n * 2 * side) if vo is not None else (None, none16, none16, 0)
        tab = self._numba_tables
        encode = encode_append_parallel if n >= PARALLEL_SLOTS else encode_append  # a decode step: no threads
        written = encode(xk.numpy(), xv.numpy(), *tab, k_words, v_words, v_sz, ko is not None, k_ptr, k_base, k_chan,
                         k_val, side, v_chan, v_val)
        if ko is not None:
            ko.commit(n, k_base, written)
        if vo is not None:
            vo.commit(n, v_base, n * 2 * side)

    @functools.cached_property
    def _numba_tables(self) -> tuple:
        """What the numba encoder reads of the quantizers: the key range, scale and zero-point [C] and, of keys
        and values, each channel's codebook midpoints [C, M], their count [C] and its stream bit offsets [C + 1]."""
        kq = self.key_quantizer
        out = [kq.lo, kq.hi, self.k_scale.float(), self.k_zero.float()]
        for q in (kq, self.value_quantizer):
            out += [*q.channel_midpoints(self.channels), q.stream_offsets(self.channels)]
        return tuple(x.float().cpu().contiguous().numpy() if x.is_floating_point() else x.contiguous().numpy()
                     for x in out)

    def _take_sinks(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """Mark the new tokens that are sinks [B, T] and store them in fp16."""
        b, t, _ = keys.shape
        real = torch.ones(b, t, dtype=torch.bool, device=keys.device) if real is None else real.to(torch.bool)
        if self.sinks == 0:
            return torch.zeros_like(real)
        # ranked after every sink the row ever took: one a sliding window dropped is not replaced
        rank = self.sinks_taken.to(keys.device).view(-1, 1) + real.long().cumsum(dim=1) - 1  # [B, T]
        sink = real & (rank < self.sinks)
        self.sinks_taken += sink.sum(dim=1).to(self.sinks_taken.device)
        self._write_table(0, self.sinks, sink, rank, keys, values)
        return sink

    def _take_window(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None,
                     sink: torch.Tensor) -> None:
        """Copy the new tokens that end among each row's last `window` real non-sink tokens into the window."""
        b, t, _ = keys.shape
        taken = real.to(torch.bool) & ~sink if real is not None else ~sink
        rank = self.window_taken.to(keys.device).view(-1, 1) + taken.long().cumsum(dim=1) - 1  # [B, T]
        total = self.window_taken + taken.sum(dim=1).to(self.window_taken.device)
        keep = taken & (rank >= (total.to(keys.device) - self.window).view(-1, 1))  # one token per entry
        self.window_taken = total
        self._write_table(self.sinks, self.window, keep, rank % self.window, keys, values)

    def _write_table(self, first: int, entries: int, chosen: torch.Tensor, entry: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Copy new token t of row b into table entry first + entry[b, t] where chosen[b, t] (bool [B, T]; at
        most one token per entry). Shapes never depend on how many are chosen: nothing waits for the device."""
        b, t, c = keys.shape
        if t == 0:
            return
        hit = chosen[:, :, None] & (entry[:, :, None] == torch.arange(entries, device=keys.device))  # [B, T, E]
        taken = hit.any(dim=1)  # [B, E]
        src = hit.to(torch.uint8).argmax(dim=1)  # [B, E]: the token each taken entry gets
        idx = src[:, :, None].expand(b, entries, c)
        table = slice(first, first + entries)
        for dst, x in ((self.sink_k, keys), (self.sink_v, values)):
            dst[:, table] = torch.where(taken[:, :, None], x.gather(1, idx).half(), dst[:, table])
        self.sink_slot[:, table] = torch.where(taken, (src + self.tokens).to(torch.int32), self.sink_slot[:, table])

    def window_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fp16 window's pre-RoPE keys, values [B, window, C] and token index [B, window] (-1: empty)."""
        s = self.sinks
        return self.sink_k[:, s:], self.sink_v[:, s:], self.sink_slot[:, s:]

    def dequantize_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot as its codes (and outliers) give it, sinks exact but the fp16 window not read: what the
        tokens older than a query's window look like. Float32 [T, B, C] each."""
        view = self.view()
        s = self.sinks
        return dequantize_view(view._replace(sink_k=view.sink_k[:, :s], sink_v=view.sink_v[:, :s],
                                             sink_slot=view.sink_slot[:, :s], memo={}))

    # ---- reading -------------------------------------------------------------------------
    def view(self) -> StoreView:
        """What the decode kernels read: this store's allocations and the rows in use (see `kernels.StoreView`).

        Successive views share one memo for as long as the store keeps the same allocations."""
        k_out, v_out = self.k_outliers, self.v_outliers
        allocations = (self.k_codes.storage, self.v_codes.storage, self.v_scale_zero.storage, self.sink_k,
                       self.sink_v, self.sink_slot, self.positions.storage,
                       *(k_out.storages if k_out is not None else ()), *(v_out.storages if v_out is not None else ()))
        if len(allocations) != len(self._allocations) or not all(map(operator.is_, allocations, self._allocations)):
            self._allocations, self._memo = allocations, {}  # derived data of other allocations must go with them
        return StoreView(self.heads, self.head_dim, self.k_bits, self.v_bits, self.tokens, allocations[0],
                         allocations[1], self.k_scale, self.k_zero, self.k_levels, self.v_levels, allocations[2],
                         self._outliers(k_out), self._outliers(v_out), self.sink_k, self.sink_v, self.sink_slot,
                         allocations[6], self._memo, self.k_offsets, self.v_offsets)

    def _outliers(self, sparse: TokenOutliers | None) -> Outliers | None:
        if sparse is None:
            return None
        pointers = None if sparse.fixed is not None else sparse.pointers.storage
        return Outliers(pointers, sparse.channels.storage, sparse.values.storage, sparse.entries, sparse.fixed,
                        self.OUTLIER_CODE)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (pre-RoPE) and values of every slot, float32 [T, B, C] each."""
        return dequantize_view(self.view())

    # ---- editing -------------------------------------------------------------------------
    def window_state(self) -> WindowState:
        """The sink and window tables as they are now: `crop(tokens, state)` back to this many tokens then holds
        the window exactly, whatever was appended in between."""
        return WindowState(self.tokens, self.batch, self.sink_k.clone(), self.sink_v.clone(), self.sink_slot.clone(),
                           self.sinks_taken.clone(), self.window_taken.clone())

    def crop_blocker(self, tokens: int) -> str | None:
        """Why `crop(tokens)` without a `window_state` would lose part of the fp16 window, or None.

        A row's window holds its last `window` real tokens that are no sinks; one that left it was overwritten
        and is held in its codes only. Once a row's window has taken more than `window` tokens, cutting any
        token it holds would let older tokens back into the window that no longer have their fp16 copies."""
        if not self.window or tokens >= self.tokens:
            return None
        cut = (self.sink_slot[:, self.sinks:] >= tokens).any(dim=1)
        wrapped = self.window_taken.to(cut.device) > self.window
        if not bool((cut & wrapped).any()):
            return None
        return (f"cutting {self.tokens - tokens} token(s) of a cache that keeps each row's {self.window} most recent "
                f"tokens in fp16 would leave the tokens that move back into that window without their fp16 copies "
                "(they were overwritten, and are held in their codes only)")

    def crop(self, tokens: int, state: WindowState | None = None) -> None:
        """Keep the first `tokens` slots of every row. With an fp16 window: `state` (`window_state()` taken when
        the store held `tokens` tokens) puts the window back as it was then; without it, a crop that would lose
        part of the window is refused (`crop_blocker`)."""
        if state is not None:
            if (state.tokens, state.batch) != (tokens, self.batch):
                raise ValueError(f"a window state of {state.tokens} tokens and {state.batch} row(s) restores a crop "
                                 f"to {state.tokens} tokens of {state.batch} row(s), not to {tokens} of {self.batch}")
            if tokens > self.tokens:
                raise ValueError(f"cannot crop {self.tokens} tokens back to {tokens}")
        else:
            reason = self.crop_blocker(tokens)
            if reason is not None:
                raise WindowCropError(reason)
            if tokens == self.tokens:  # nothing cut: the window's ring stays as it is, wrapped or not
                return
        for buf in (self.k_codes, self.v_codes, self.v_scale_zero):
            buf.truncate(tokens)
        for sparse in self._sparse():
            sparse.truncate(tokens * self.batch)
        if state is not None:  # the tables as they were at `tokens` tokens
            mine = (self.sink_k, self.sink_v, self.sink_slot, self.sinks_taken, self.window_taken)
            kept = (state.sink_k, state.sink_v, state.sink_slot, state.sinks_taken, state.window_taken)
            if all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device for a, b in zip(mine, kept)):
                for a, b in zip(mine, kept):  # in place: the views' memos of these tensors stay valid
                    a.copy_(b)
            else:
                (self.sink_k, self.sink_v, self.sink_slot, self.sinks_taken,
                 self.window_taken) = (x.clone() for x in kept)
        else:
            gone = self.sink_slot >= tokens
            self.sinks_taken -= gone[:, : self.sinks].sum(dim=1)
            self.sink_slot[gone] = -1
            self.sink_k[gone] = 0
            self.sink_v[gone] = 0
            if self.window:
                self._repack_window()
        if self.owns_positions:
            self.positions.truncate(tokens)

    def _repack_window(self) -> None:
        """After a crop that `crop_blocker` lets through (no row's window had wrapped): each row's remaining window
        entries, oldest first, at the start of the ring; the window fills again with new tokens."""
        s = self.sinks
        for r in range(self.batch):
            slots = self.sink_slot[r, s:]
            order = torch.argsort(torch.where(slots >= 0, slots.long(), torch.iinfo(torch.int64).max))
            n = int((slots >= 0).sum())
            for table in (self.sink_k, self.sink_v, self.sink_slot):
                table[r, s:] = table[r, s:][order]
            self.window_taken[r] = n

    def drop_front(self, tokens: int) -> None:
        """Forget the first `tokens` slots of every row (a sliding window moving on), sinks among them included.

        The store must keep its own positions: a log shared with other layers keeps every token."""
        if not 0 <= tokens <= self.tokens:
            raise ValueError(f"cannot drop {tokens} of {self.tokens} tokens")
        if tokens == 0:
            return
        if not self.owns_positions:
            raise RuntimeError("a store whose positions are shared with other layers cannot drop tokens")
        for buf in (self.k_codes, self.v_codes, self.v_scale_zero):
            buf.drop_front(tokens)
        kept = torch.arange(tokens * self.batch, (tokens + self.tokens) * self.batch, device=self.device)
        for sparse in self._sparse():
            sparse.select(kept)
        self.sink_slot -= torch.where(self.sink_slot >= 0, tokens, 0).to(torch.int32)
        gone = self.sink_slot < 0
        self.sink_slot[gone] = -1
        self.sink_k[gone] = 0
        self.sink_v[gone] = 0
        self.positions.drop_front(tokens)

    def gather_rows(self, index: torch.Tensor) -> None:
        """Make row i the old row index[i] (beam reorder, batch select, repeat-interleave)."""
        index = index.to(self.device).long()
        t, b = self.tokens, self.batch
        for buf in (self.k_codes, self.v_codes, self.v_scale_zero):
            buf.replace(buf.view().index_select(1, index))
        order = (torch.arange(t, device=self.device).view(-1, 1) * b + index.view(1, -1)).reshape(-1)
        for sparse in self._sparse():
            sparse.select(order)
        self.sink_k, self.sink_v = self.sink_k[index], self.sink_v[index]
        self.sink_slot, self.sinks_taken = self.sink_slot[index], self.sinks_taken[index]
        self.window_taken = self.window_taken[index]
        self.batch = index.numel()
        if self.owns_positions and len(self.positions):
            self.positions.gather_rows(index)

    def reset(self) -> None:
        self._allocate(0)
        if self.owns_positions:
            self.positions.clear()

    def _sparse(self) -> list[TokenOutliers]:
        return [s for s in (self.k_outliers, self.v_outliers) if s is not None]

    def unsettled(self) -> list[TokenOutliers]:
        """The outlier arrays a decode step left room in (`TokenOutliers.append_unsettled`), to settle."""
        return [s for s in self._sparse() if s.unsettled]

    def settle(self) -> None:
        """Cut the outlier arrays to the outliers (reads their count: a cache does it for all layers at once)."""
        for sparse in self.unsettled():
            sparse.settle()

    # ---- bytes ---------------------------------------------------------------------------
    def component_bytes(self) -> dict[str, int]:
        """Bytes in use by component, measured on the arrays held (`kvsqueeze.storage` says what each one holds and
        counts the same from the method's layout)."""
        n_sinks = int(self.sink_count.sum())
        slots = self.tokens * self.batch
        c = self.channels
        slot_code_bytes = 4 * (self._words("k") + self._words("v"))  # int32 words
        sparse = self._sparse()
        ptr = sum(s.pointer_itemsize for s in sparse)
        # fixed-count rows (per-token top-k values, key slots) hold padding entries in sink slots
        pad = n_sinks * 2 * sum(s.fixed for s in sparse if s.fixed is not None)
        return {
            "codes": (slots - n_sinks) * slot_code_bytes,
            "scales": self.k_scale.nbytes + self.k_zero.nbytes + (slots - n_sinks) * 4,  # + fp16 (s, z) per slot
            "outlier_values": sum(s.value_nbytes for s in sparse) - pad,
            "outlier_indices": sum(s.index_nbytes for s in sparse) - pad,
            "pointers": sum(s.pointer_nbytes for s in sparse) - n_sinks * ptr,
            "sinks": n_sinks * c * 2 * 2,  # K and V, fp16
            "fp16_window": int(self.window_count.sum()) * c * 2 * 2,  # K and V, fp16, beside their codes
            "codebook": self._quantizer_nbytes(),
            "decode_tables": self._decode_table_nbytes(),
            "sink_slots": n_sinks * (slot_code_bytes + 4 + ptr) + 2 * pad + self.sink_slot.nbytes,
        }

    def capacity_nbytes(self) -> int:
        """Bytes allocated, growth slack and empty sink rows included."""
        grids = sum(buf.capacity_nbytes for buf in (self.k_codes, self.v_codes, self.v_scale_zero))
        sparse = sum(s.capacity_nbytes for s in self._sparse())
        fixed = sum(x.nbytes for x in (self.k_scale, self.k_zero, self.sink_k, self.sink_v, self.sink_slot))
        return grids + sparse + fixed + self._quantizer_nbytes() + self._decode_table_nbytes()

    def _quantizer_nbytes(self) -> int:
        """Codebooks (float32 levels, exactly what decoding reads) and the key thresholds encoding reads; where
        channels have widths of their own, every codebook they use and a byte per channel for its width."""
        kq, vq = self.key_quantizer, self.value_quantizer
        n = sum(x.nbytes for x in (kq.lo, kq.hi))
        for q in (kq, vq):
            if q.widths is None:
                n += q.levels.nbytes
            else:
                n += sum(cb.nbytes for cb in q.codebooks.values()) + q.widths.numel()
        if vq.mat_lo is not None:
            n += 8  # per-matrix value thresholds, two float32
        return n

    def _decode_table_nbytes(self) -> int:
        """The per-channel level tables and bit offsets the kernels read where channels have widths of their own:
        derived from the codebooks, and held for as long as the store."""
        return sum(levels.nbytes + offsets.nbytes for levels, offsets in
                   ((self.k_levels, self.k_offsets), (self.v_levels, self.v_offsets)) if offsets is not None)
