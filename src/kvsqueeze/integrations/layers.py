"""transformers cache layers over the compressed store: pre-RoPE keys in, RoPE re-applied on read.

`CompressedLayer` implements transformers' `CacheLayerMixin` contract on top of
one `KVStore` (one per model layer); `Fp16Layer` is the fp16 baseline with the
same memory accounting. No model code is forked.

Why hooks rather than un-rotating: `update` receives post-RoPE keys. Undoing
RoPE with cos/sin recomputed from the positions is exact only up to float
rounding, and a key that lands on a quantization boundary would then get a
different code than the simulated path gives it; capturing the keys where the
model hands them to its rotary step (`capture.py`, `parts.key_module`) stores
exactly what KVQuant quantizes, so cache and simulation agree bit for bit.
Each captured tensor is checked against the post-RoPE keys the model passed
(re-rotating it must reproduce them). A key that cannot be captured, or whose
capture does not rotate into the model's key, is an error: the recipe's
per-channel statistics describe the captured tensor, and quantizing another
one with them would be silently wrong (`preflight.py` refuses such models
before any work).

Positions: RoPE is re-applied at read time with the positions the model used,
taken from the `position_ids` that reach `update`; the stores of one cache
share one `PositionLog` (`kvsqueeze.cache.positions`).

Fused decode (`fused.py`): a layer given a decode backend compresses a single
new token as usual but, instead of dequantizing the whole cache, returns empty
[B, H, 0, D] tensors that name the layer (`decode_marker`); the attention
function then reads the layer's store through the kernels.

An fp16 window of recent tokens (`:rN` methods, `KVStore.window`): a decode
step (one query) reads it from the store's table like the sinks, in the fused
kernels and in `read` alike. A forward of several tokens needs, for each query, its own
window in fp16 and every older token quantized: the layer returns every
token's keys and values as their codes give them, with fp16 copies of the
tokens its queries' windows reach (the window held before this forward and
the new tokens) attached (`QUANTIZED`, a `WindowCopies`), and the
"kvsqueeze" attention (which `cache_for` selects for such methods) reads
both, as the simulated path does.

Padding: pad tokens are stored like any token (attention masks them, keys use
offline statistics and values per-token ones, so they cannot disturb real
tokens), but never become sinks: sinks are each row's first real tokens, read
from the 2-D attention mask of the forward (no mask: every token is real).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache.buffers import GrowableTensor
from ..cache.store import KVStore, WindowCropError
from ..numerics.affine import FP16_MAX
from ..numerics.rope import Rope
from .attention import ATTN_NAME, EAGER_NAME
from .parts import LayerRotary



class CacheValueError(ValueError):
    """Keys or values a cache cannot hold (beyond fp16's range, NaN or Inf)."""


MARKER = "kvsqueeze_layer"  # attribute of the empty key tensor a fused decode step returns
QUANTIZED = "kvsqueeze_quantized"  # attribute of the keys a windowed layer returns: its `WindowCopies`


class WindowCopies(NamedTuple):
    """What a windowed layer's keys carry (`QUANTIZED`) for the "kvsqueeze" attention. The keys and values the
    layer returns, [B, H, T, D], are one copy of every cached token; this holds the other: the quantized copies
    (RoPE applied) when the returned ones are exact (the simulated path; `exact` False, `start` 0), or exact copies
    of the tokens from position `start` on, which the windows of the forward's queries reach, when the returned
    ones are quantized (the compressed cache; `exact` True). Never the returned tensors themselves: a key that
    carried itself would stay alive until the garbage collector found the cycle."""
    k: torch.Tensor
    v: torch.Tensor
    exact: bool
    start: int
    window: int


class LayerBase(CacheLayerMixin):
    """What both kvsqueeze layers share: length bookkeeping, the sliding window and the batch-row operations
    generate() uses.

    A sliding-window layer (`window`: the model attends to the last `window` tokens, as Mistral's layers or
    Gemma-3's local ones) keeps what transformers' `DynamicSlidingWindowLayer` keeps: the last window - 1
    tokens after each forward, up to `EVICT_SLACK` more while fused decode steps run (tokens are dropped in
    batches there, before a step, so that the kernel reads the store as it was written). It reports the
    dropped tokens to the mask as an offset, like transformers' layer.
    """

    EVICT_SLACK = 64  # tokens a sliding layer may keep past its window between two drops in fused decode

    def __init__(self, window: int | None = None):
        super().__init__()
        if window is not None and window < 2:
            raise ValueError(f"a sliding window of {window} tokens keeps no past; expected 2 or more")
        self.window = window
        self.dropped = 0  # tokens a sliding window moved past, per row
        self._lineage = 0
        self._new_history()

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can always put this layer back as it was, as transformers' assisted decoding asks of a
        cache before it crops draft tokens: not a sliding layer (its dropped tokens are gone) nor one holding an
        fp16 window (cropping past its wrap would lose exact copies). `checkpoint` / `rollback` return exactly."""
        return self.window is None and not self.holds_window

    holds_window = False  # a layer whose store keeps an fp16 window of recent tokens (`:rN`)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    in_cache = False  # set by a cache that reads what decode steps leave on the device (`settle_step`)
    pending = None  # float32 scalar on the device: the largest magnitude of the steps since the last read
    pending_what = ""  # the cache's name for the message of a refused step

    def check_storable(self, keys: torch.Tensor, values: torch.Tensor, what: str) -> None:
        """Refuse keys or values that this cache's fp16 parts cannot hold (beyond 65,504, NaN or Inf), naming the
        layer and what to do. A forward of several tokens is read at once, before anything is stored. A single
        token in a cache only folds its largest magnitude into `pending`, on the device: the cache reads every
        layer's at once when the forward's last layer has stored its token (`settle_step`), so that a decode step
        waits for the device once, not once per layer, and still raises before its logits are returned."""
        if self.in_cache and keys.shape[-2 if keys.dim() == 4 else 1] == 1:
            m = torch.maximum(keys.detach().abs().amax(), values.detach().abs().amax()).float()
            self.pending = m if self.pending is None else torch.maximum(self.pending, m)
            self.pending_what = what
            return
        if keys.device.type == "cpu" and keys.dtype in (torch.float32, torch.float16) and values.dtype == keys.dtype:
            kn, vn = keys.detach().numpy(), values.detach().numpy()
            if kn.size <= 1 << 16:  # a few tokens: one temporary of |x| is the cheapest
                a, b = float(np.abs(kn).max(initial=0)), float(np.abs(vn).max(initial=0))
                m = a if (a >= b or a != a) else b  # a NaN in either stays NaN
            else:  # a long prefill: four reductions in place, no copy of the activations
                m = float(np.max([kn.max(), -kn.min(), vn.max(), -vn.min()]))
        else:
            m = float(torch.maximum(keys.detach().abs().amax(), values.detach().abs().amax()))
        self.refuse(m, what, stored=False)

    def refuse(self, m: float, what: str, stored: bool) -> None:
        """Raise CacheValueError unless `m`, the largest magnitude of keys and values, fits fp16 (`stored`: the
        cache holds them already)."""
        if m <= FP16_MAX:  # NaN fails this too
            return
        layer = getattr(self, "layer_idx", "?")
        after = ("the cache took this step before the check: reset() it before using it again" if stored
                 else f"layer {layer} stored nothing, but the layers before it took this forward's tokens: reset() "
                 "the cache before using it again")
        if math.isnan(m) or math.isinf(m):
            raise CacheValueError(
                f"layer {layer}: the model's keys or values hold NaN/Inf before they reach the {what} cache: the "
                f"model itself overflowed (its weights, its inputs or its dtype); {after}")
        raise CacheValueError(
            f"layer {layer}: keys or values reach {m:.4g}, beyond fp16's range (65,504) in which the {what} cache "
            f"stores them (its scales, outliers, sinks and window, or all of it for fp16); {after}. This model "
            "needs a cache in its own dtype: run it without kvsqueeze's cache (transformers' DynamicCache)")

    def kept_tokens(self) -> int:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.dropped + self.kept_tokens()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept_tokens() + query_length, self.dropped

    def get_max_length(self) -> int:
        return self.window if self.window is not None else -1

    def crop_target(self, tokens_to_remove: int) -> int | None:
        """The length `crop(tokens_to_remove)` leaves (None: nothing to do), refused here if the layer could not
        then hold what the next token reads: the last window - 1 tokens of a sliding layer, the fp16 copies of
        a store's window (`KVStore.crop_blocker`). Nothing is changed: a cache checks every layer first."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return None
        target = max(self.get_seq_length() + tokens_to_remove, 0)
        need = 0 if self.window is None else max(0, target - self.window + 1)  # the next token reads from here on
        if self.dropped > need:
            raise RuntimeError(f"this sliding-window layer (window {self.window}) no longer holds the tokens before "
                               f"position {self.dropped}; cropped to {target} tokens, the next token would read "
                               f"from position {need} on, so it cannot be cropped there")
        self._check_crop(target - self.dropped)
        return target

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers' convention: a negative count)."""
        self.crop_to(self.crop_target(tokens_to_remove))

    def crop_to(self, target: int | None) -> None:
        """Keep the first `target` tokens, a length `crop_target` gave and checked (None: nothing to do)."""
        if target is not None:
            self._crop(target - self.dropped)
            self._note_crop(target)

    def _new_history(self) -> None:
        """What a checkpoint must still describe, started anew (a new layer, a reset): the cache it was taken of
        (`_lineage`, bumped by every reset), which of that cache's rows each row now holds (reorder, select and
        repeat compose it; None: each its own), and every crop since, as (serial, tokens kept)."""
        self._lineage += 1
        self._origin: torch.Tensor | None = None
        self._crops: list[tuple[int, int]] = []
        self._serial = 0

    def _note_crop(self, kept: int) -> None:
        self._serial += 1
        self._crops.append((self._serial, kept))

    def _history(self) -> tuple:
        return self._lineage, None if self._origin is None else self._origin.clone(), self._serial

    def _same_rows(self, origin: torch.Tensor | None) -> bool:
        """Whether each row holds the row it held when `origin` was taken (compared on the device, at rollback)."""
        now = self._origin
        if origin is None and now is None:
            return True
        known = origin if origin is not None else now
        own = torch.arange(known.numel(), device=known.device)  # the rows as they were: each its own
        a, b = (own if origin is None else origin), (own if now is None else now)
        return a.shape == b.shape and bool(torch.equal(a.to(b.device), b))

    def _follow_rows(self, index: torch.Tensor) -> None:
        index = index.long()
        self._origin = index.clone() if self._origin is None else self._origin[index.to(self._origin.device)]

    def checkpoint(self):
        """What `rollback` needs to return this layer exactly to its present length (`CompressedCache.checkpoint`)."""
        return self.get_seq_length(), self.dropped, None, self._history()

    def check_rollback(self, mark) -> None:
        """Refuse, before anything changes, a rollback this layer cannot make exactly: one whose rows were reordered,
        selected or repeated since, or whose tokens were cropped below the checkpoint (and perhaps written anew)."""
        tokens, dropped, _, (lineage, origin, serial) = mark
        if self.dropped != dropped:
            raise RuntimeError(f"this sliding-window layer (window {self.window}) dropped its tokens before position "
                               f"{self.dropped} after the checkpoint at {tokens} tokens; it cannot return to it")
        if lineage != self._lineage:
            raise ValueError("the cache was reset since this checkpoint: it no longer describes it")
        if not self._same_rows(origin):
            raise ValueError("the cache's rows are not those of this checkpoint, in its order (reordered, selected or "
                             "repeated since: beam search, batch_select_indices): select them back first, or take a "
                             "checkpoint after the change")
        below = [kept for s, kept in self._crops if s > serial and kept < tokens]
        if below:
            raise ValueError(f"the cache was cropped to {min(below)} tokens after this checkpoint at {tokens}: the "
                             "tokens it held may have been written anew; take a checkpoint after the crop")
        if tokens > self.get_seq_length():
            raise ValueError(f"a checkpoint at {tokens} tokens is past this layer's {self.get_seq_length()}")

    def rollback(self, mark) -> None:
        tokens, dropped, _, _ = mark
        if self.is_initialized:
            self._crop(tokens - dropped)
        self._note_crop(tokens)

    def _check_crop(self, kept: int) -> None:
        """Refuse a crop to `kept` held tokens that would lose data (a layer without an fp16 window loses none)."""

    def slide(self, slack: int = 0) -> None:
        """A sliding layer holding more than window - 1 + slack tokens drops its oldest down to window - 1."""
        if self.window is None:
            return
        extra = self.kept_tokens() - (self.window - 1)
        if extra > slack:
            self._drop_front(extra)
            self.dropped += extra

    def _drop_front(self, tokens: int) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._follow_rows(beam_idx)
            self._gather_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            index = indices.nonzero().view(-1) if indices.dtype == torch.bool else indices
            self._follow_rows(index)
            self._gather_rows(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            index = torch.arange(self.batch_size).repeat_interleave(repeats)
            self._follow_rows(index)
            self._gather_rows(index)

    def offload(self):  # the base implementation moves self.keys / self.values, which we do not hold
        raise NotImplementedError("kvsqueeze caches do not support offloading; the compressed cache is small enough")

    prefetch = offload

    def _crop(self, tokens: int) -> None:
        raise NotImplementedError

    def _gather_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError


def _positions(position_ids, batch: int, tokens: int, start: int, device) -> torch.Tensor:
    """The position of each new token [B, T] (int64), from the model's `position_ids` or counted from `start`."""
    if position_ids is None:
        return torch.arange(start, start + tokens, device=device).expand(batch, tokens)
    if position_ids.dim() != 2 or position_ids.shape[-1] != tokens:
        raise ValueError(f"expected position_ids [B, {tokens}], got {tuple(position_ids.shape)}: kvsqueeze "
                         "re-applies 1-D RoPE and does not support multi-axis position ids")
    return position_ids.to(device).long().expand(batch, tokens)


def layer_cos_sin(rotary: LayerRotary, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, R] of positions [B, T] from the layer's own rotary module, as its attention gets them
    (None: no RoPE)."""
    cs = rotary.cos_sin(positions, dtype)
    return None if cs is None else (cs[0].unsqueeze(1), cs[1].unsqueeze(1))


class PreRopeKeys:
    """What a layer that stores keys before RoPE needs: the model's cos / sin, and the captured keys, checked.

    The host class has `rotary` (a `parts.LayerRotary`), `capture` (a `ForwardCapture` or None) and `layer_idx`.
    """

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, 1, T, R] from the model's own rotary module, as its attention gets them (None: no RoPE)."""
        return layer_cos_sin(self.rotary, positions, dtype)

    keys_checked = False  # whether a forward's captured keys were held to the model's

    def _pre_rope_keys(self, key_states: torch.Tensor, cos_sin) -> torch.Tensor:
        """The captured pre-RoPE keys [B, T, C] of the new tokens, checked to rotate into key_states [B, H, T, D]
        on the layer's first forward and every forward of several tokens."""
        b, h, t, d = key_states.shape
        keys = self.capture.take_keys(self.layer_idx, b, t) if self.capture is not None else None
        if keys is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: no pre-RoPE keys were captured for these {t} tokens; a compressed cache "
                "is filled by the model's forward (model(..., cache=cache) or generate(cache=cache)), "
                "or by `append_pre_rope` with the keys before RoPE")
        if t == 1 and self.keys_checked:  # a decode step: the same capture as the checked forwards, and reading
            return keys  # the check's result would wait for the device in every layer
        self.keys_checked = True
        rotated = self.rotary.apply(keys.view(b, t, h, d).transpose(1, 2), cos_sin)
        tol = 1e-3 * float(key_states.abs().max().clamp_min(1e-6))
        if not torch.allclose(rotated, key_states, rtol=1e-3, atol=tol):
            raise RuntimeError(
                f"layer {self.layer_idx}: the captured keys do not rotate into the keys the model caches (largest "
                f"difference {float((rotated - key_states).abs().max()):.3g}); their statistics in the recipe "
                "describe another tensor, so quantizing these would be wrong. `kvsqueeze.integrations.preflight"
                ".preflight(model)` says what differs")
        return keys


class CompressedLayer(PreRopeKeys, LayerBase):
    """One layer of the compressed cache; see the module docstring.

    Args:
        store: the layer's compressed storage (its positions shared with the other layers).
        layer_idx: index of the attention module (its `k_proj` is hooked).
        rotary: how the layer turns its keys (`parts.layer_rotaries`).
        capture: the model's `ForwardCapture` (None: keys only through `append_pre_rope`).
        window: the layer's sliding window (None: it attends to every token); see `LayerBase`.
    """

    def __init__(self, store: KVStore, layer_idx: int, rotary: LayerRotary, capture=None,
                 window: int | None = None):
        super().__init__(window)
        if window is not None and not store.owns_positions:
            raise ValueError("a sliding-window layer drops its oldest tokens: its store needs positions of its own")
        self.store, self.layer_idx = store, layer_idx
        self.heads, self.head_dim = store.heads, store.head_dim
        self.rotary, self.capture = rotary, capture
        self.closed = False
        self.method_name = "compressed"  # the method's name, for messages (`cache_for` sets it)
        self.decode_backend = None  # a `kernels.Backend`: single-token updates return a marker (`fused.py`)

    @property
    def batch_size(self) -> int:
        return self.store.batch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def kept_tokens(self) -> int:
        return self.store.tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Compress the new tokens [B, H, T, D] (keys post-RoPE) and return every cached K and V [B, H, T', D]."""
        if self.closed:
            raise RuntimeError("this kvsqueeze cache was closed (its hooks are gone): build a new one with cache_for")
        extra = kwargs.get("kwargs") or {}  # transformers passes the attention kwargs through as `kwargs=`
        b, h, t, d = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        fused = self.decode_backend is not None and t == 1
        if fused:
            self._check_fused_attention()
            self.slide(self.EVICT_SLACK)  # before the step: the kernel reads the store after update returns
        start = self.get_seq_length()
        given = extra.get("position_ids", kwargs.get("position_ids"))
        if given is None and self.capture is not None:
            given = self.capture.positions(t)
        positions = _positions(given, b, t, start, key_states.device)
        keys = self._pre_rope_keys(key_states, self._cos_sin(positions, key_states.dtype))  # [B, T, C]
        values = value_states.transpose(1, 2).reshape(b, t, h * d)  # [B, T, C]
        real = self.capture.real_tokens(b, t) if self.capture is not None else None
        # one query reads its window from the store's table, as `read` gives it; several need their own windows
        windowed = self.store.window and not fused and t > 1
        if windowed:
            self._check_window_attention()
            held = [x.clone() for x in self.store.window_entries()]  # what this forward's first queries reach
        self.append_pre_rope(keys, values, positions, real)
        if fused:
            return self.decode_marker(key_states.dtype)
        out = self._read_windowed(held, keys, values, key_states.dtype) if windowed else self.read(key_states.dtype)
        self.slide()  # what this forward attends to was read: keep the last window - 1 tokens
        return out

    attention_config = None  # the model's config: its attention must read the window (a windowed store) or the marker

    def _check_fused_attention(self) -> None:
        """A decode step returns an empty marker that only kvsqueeze's attention turns into the step's attention;
        any other attention would read it as a cache of no tokens and return zeros."""
        self._check_attention(
            "fused decode is on for this cache", "that attention cannot read it (another fused_decode on this model "
            "was closed first, or the attention was set again): leave fused decode (`close()`) or enable it again")

    def _check_window_attention(self) -> None:
        self._check_attention(
            f"this cache keeps its {self.store.window} most recent tokens in fp16, which only kvsqueeze's attention "
            "reads", "build the cache with `kvsqueeze.cache_for` (it selects that attention) and do not change the "
            "model's attention after")

    def _check_attention(self, why: str, fix: str) -> None:
        impl = getattr(self.attention_config, "_attn_implementation", None)
        if impl not in (ATTN_NAME, EAGER_NAME):
            raise RuntimeError(f"layer {self.layer_idx}: {why}, and the model now runs attention {impl!r}; {fix}")

    def _read_windowed(self, held, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype):
        """Every cached token as the queries of a forward of the new `keys`, `values` [B, T, C] read it: keys (RoPE
        applied) and values [B, H, T', D] as their codes give them, which are returned, and carrying (`QUANTIZED`)
        fp16 ones of the tokens the queries' windows reach: the window held before this forward (`held`) and the
        new tokens. Only that tail is copied, so a short forward over a long cache builds one full copy, not two."""
        qk, qv = self.store.dequantize_codes()  # [T', B, C] float32, keys pre-RoPE
        total, t = qk.shape[0], keys.shape[1]
        start = max(0, total - t - self.store.window + 1)  # older tokens are out of every new query's window
        ek, ev = qk[start:].clone(), qv[start:].clone()
        hk, hv, hslot = held
        rows, entries = (hslot >= start).nonzero(as_tuple=True)
        slots = hslot[rows, entries].long() - start
        ek[slots, rows], ev[slots, rows] = hk[rows, entries].float(), hv[rows, entries].float()
        ek[-t:], ev[-t:] = keys.transpose(0, 1).half().float(), values.transpose(0, 1).half().float()
        cos_sin = self._cos_sin(self.store.positions.view()[:total].t(), dtype)  # [B, 1, T', R] each
        tail = None if cos_sin is None else tuple(c[:, :, start:] for c in cos_sin)
        out = []
        for k, v, cs in ((qk, qv, cos_sin), (ek, ev, tail)):
            k = k.view(k.shape[0], k.shape[1], self.heads, self.head_dim).permute(1, 2, 0, 3).to(dtype)
            v = v.view(v.shape[0], v.shape[1], self.heads, self.head_dim).permute(1, 2, 0, 3).to(dtype)
            out.append((self.rotary.apply(k, cs), v))
        (qk, qv), (ek, ev) = out
        setattr(qk, QUANTIZED, WindowCopies(ek, ev, True, start, self.store.window))
        return qk, qv

    def append_pre_rope(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        real: torch.Tensor | None = None) -> None:
        """Append tokens given before RoPE (`update` does this; also for filling a cache from captured activations).

        Args:
            keys: the `k_proj` output [B, T, C]; values: the `v_proj` output [B, T, C].
            positions: RoPE position of each token [B, T] (int).
            real: bool [B, T], False at padding tokens (None: all real).
        """
        if not self.is_initialized:
            self.device, self.dtype = keys.device, keys.dtype
            self.is_initialized = True
        self.check_storable(keys, values, self.method_name)
        self.store.append(keys, values, real, positions)

    def read(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached key (RoPE applied) and value, [B, H, T, D] in `dtype` (default: the model's)."""
        dtype = dtype or self.dtype
        k, v = self.store.dequantize()  # [T, B, C] float32, keys pre-RoPE
        t, b = k.shape[:2]
        k = k.view(t, b, self.heads, self.head_dim).permute(1, 2, 0, 3).to(dtype)  # [B, H, T, D]
        v = v.view(t, b, self.heads, self.head_dim).permute(1, 2, 0, 3).to(dtype)
        return self.rotary.apply(k, self._cos_sin(self.store.positions.view()[:t].t(), dtype)), v

    def decode_marker(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty keys and values [B, H, 0, D] that carry this layer, for the attention function to find."""
        marker = torch.empty(self.store.batch, self.heads, 0, self.head_dim, dtype=dtype, device=self.store.device)
        setattr(marker, MARKER, self)
        return marker, marker

    @property
    def rope(self) -> Rope:
        """The layer's RoPE frequencies for the kernels (`LayerRotary.rope`)."""
        return self.rotary.rope

    def _crop(self, tokens: int) -> None:
        self.store.crop(tokens)

    def _check_crop(self, kept: int) -> None:
        reason = self.store.crop_blocker(kept)
        if reason is not None:
            raise WindowCropError(
                f"layer {self.layer_idx} ({self.method_name}): {reason}. Take `mark = cache.checkpoint()` before the "
                "tokens you will cut and return with `cache.rollback(mark)`, which restores the window exactly; or "
                "use a method without an fp16 window (no ':rN')")

    @property
    def holds_window(self) -> bool:
        return bool(self.store.window)

    def checkpoint(self):
        return (self.get_seq_length(), self.dropped, self.store.window_state() if self.store.window else None,
                self._history())

    def check_rollback(self, mark) -> None:
        state = mark[2]
        if state is not None and state.batch != self.store.batch:
            raise ValueError(f"the checkpoint holds {state.batch} row(s) and the cache {self.store.batch}: select "
                             "the rows back (batch_select_indices) before rolling back")
        super().check_rollback(mark)

    def rollback(self, mark) -> None:
        tokens, dropped, state, _ = mark
        if self.is_initialized:
            self.store.crop(tokens - dropped, state)
        self._note_crop(tokens)

    def _drop_front(self, tokens: int) -> None:
        self.store.drop_front(tokens)

    def _gather_rows(self, index: torch.Tensor) -> None:
        self.store.gather_rows(index)

    def reset(self) -> None:
        self.store.reset()
        self._new_history()
        self.dropped = 0
        self.pending = None
        self.is_initialized = False

    def component_bytes(self) -> dict[str, int]:
        comps = self.store.component_bytes()
        if self.store.owns_positions:  # a sliding layer's own positions (the shared log is counted once)
            comps["positions"] = self.store.positions.nbytes
        return comps

    def capacity_nbytes(self) -> int:
        own = self.store.positions.capacity_nbytes if self.store.owns_positions else 0
        return self.store.capacity_nbytes() + own


class Fp16Layer(LayerBase):
    """The fp16 baseline: post-RoPE keys and values rounded to fp16, [T, B, H, D] growable buffers."""

    def __init__(self, window: int | None = None):
        super().__init__(window)
        self.k = self.v = None

    @property
    def batch_size(self) -> int:
        return self.k.row_shape[0] if self.k is not None else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        row = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        self.k = GrowableTensor(row, torch.float16, self.device)
        self.v = GrowableTensor(row, torch.float16, self.device)
        self.is_initialized = True

    def kept_tokens(self) -> int:
        return len(self.k) if self.k is not None else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_storable(key_states, value_states, "fp16")
        self.k.append(key_states.permute(2, 0, 1, 3))  # [T, B, H, D]
        self.v.append(value_states.permute(2, 0, 1, 3))
        out = self.read(key_states.dtype)
        self.slide()
        return out

    def read(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtype or self.dtype
        # convert the contiguous [T, B, H, D] buffers, then view them as [B, H, T, D]
        return self.k.view().to(dtype).permute(1, 2, 0, 3), self.v.view().to(dtype).permute(1, 2, 0, 3)

    def _crop(self, tokens: int) -> None:
        self.k.truncate(tokens)
        self.v.truncate(tokens)

    def _drop_front(self, tokens: int) -> None:
        self.k.drop_front(tokens)
        self.v.drop_front(tokens)

    def _gather_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device).long()
        self.k.replace(self.k.view().index_select(1, index))
        self.v.replace(self.v.view().index_select(1, index))

    def reset(self) -> None:
        self.k = self.v = None
        self._new_history()
        self.dropped = 0
        self.pending = None
        self.is_initialized = False

    def component_bytes(self) -> dict[str, int]:
        return {"codes": (self.k.nbytes + self.v.nbytes) if self.k is not None else 0}

    def capacity_nbytes(self) -> int:
        return (self.k.capacity_nbytes + self.v.capacity_nbytes) if self.k is not None else 0


def settle_step(layers: list) -> None:
    """Read what the single-token updates of a forward left on the device, once for all `layers`: each layer's
    largest magnitude (`LayerBase.check_storable`, refused beyond fp16's range) and the count of the outliers
    its store made room for (`TokenOutliers.append_unsettled`). A cache calls it after its last layer's update."""
    guarded = [layer for layer in layers if layer.pending is not None]
    loose = [s for layer in layers if isinstance(layer, CompressedLayer) for s in layer.store.unsettled()]
    if not guarded and not loose:
        return
    groups = [[layer.pending.view(1) for layer in guarded], [s.device_nnz().view(-1) for s in loose]]
    device = (guarded[0].pending if guarded else groups[1][0]).device
    # one cat per kind (a few ops, not one per layer), then the forward's one wait
    read = torch.cat([torch.cat(g).to(device, torch.float64) for g in groups if g]).tolist()
    for s, n in zip(loose, read[len(guarded):]):
        s.settle(int(n))
    for layer in guarded:
        layer.pending = None
    for layer, m in zip(guarded, read):
        layer.refuse(m, layer.pending_what, stored=True)
