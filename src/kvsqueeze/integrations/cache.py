"""`cache_for(model, recipe, method)`: the compressed KV cache as a transformers `Cache`.

Usage::

    cache = kvsqueeze.cache_for(model, "recipe-dir", "q3.5")
    out = model.generate(ids, cache=cache, max_new_tokens=64)
    print(cache.memory_report().format())
    cache.close()  # or `with kvsqueeze.cache_for(...) as cache:`; dropping the cache also works

Supported: `fp16` and the KVQuant-style methods, i.e. the int / nf / nuq
families with keys per channel before RoPE and values per token, outliers per
vector or per matrix, and sinks (Hooper et al., arXiv 2401.18079). Methods
that quantize keys after RoPE or per token, and KIVI / grouped methods, are
evaluated with the simulated path (`SimulatedQuantization`, `kvsqueeze eval`).

The cache installs forward hooks on the model (`capture.py`), shared by all
caches of that model and removed when the last one is closed or collected.
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from ..cache.positions import PositionLog
from ..cache.report import COMPONENTS, MemoryReport
from ..cache.store import KVStore
from ..config import DEFAULT_METHOD
from ..methods import DEFAULT_CONTEXT, MethodError, MethodSpec, family, preset_for
from ..methods import build_quantizers
from ..numerics.quantizer import VectorQuantizer
from ..recipe import Recipe
from ..storage import held_by_layer
from ..shape import KVShape, kv_shape
from .attention import register_handler, switch_attention
from .capture import ForwardCapture
from .fingerprint import check_recipe
from .layers import CompressedLayer, Fp16Layer, settle_step
from .parts import attention_modules, layer_rotaries
from .preflight import model_windows, preflight
from .simulate import SIMULATING, window_handler

SUPPORTED = ("fp16, and int / nf / nuq with keys per channel before RoPE and values per token, outliers per "
             "vector or per matrix, any sinks, bit budgets and fp16 windows: e.g. 'nuq3-1%', 'nuq4', 'nuq2-1%:pm', "
             "'nf3-1%:kchan:pre', 'nuq@3.49:r32:chan'")


def check_supported(spec: MethodSpec) -> None:
    """Raise MethodError unless the compressed cache can store `spec` (its family says, `methods.families`)."""
    reason = family(spec).why_not(spec, "cache")
    if reason:
        raise MethodError(
            f"method {spec.name!r} has no compressed cache: {reason}. Supported: {SUPPORTED}. Evaluate other "
            "methods with the simulated path (`kvsqueeze eval --methods ...` or `SimulatedQuantization`)"
        )


def _to_device(q: VectorQuantizer, device: torch.device) -> VectorQuantizer:
    return q.to(device)


class CompressedCache(Cache):
    """A transformers `Cache` of kvsqueeze layers, plus the positions they share and the memory report.

    Build it with `cache_for`. Use one cache per batch of sequences; `reset()`
    empties it for the next batch.
    """

    def __init__(self, layers: list, spec: MethodSpec, shape: KVShape, positions: PositionLog | None,
                 capture: ForwardCapture | None):
        super().__init__(layers=layers)
        for layer in layers:
            layer.in_cache = True  # a decode step's checks are read once, after the last layer (`update`)
        self.spec, self.shape, self.positions = spec, shape, positions
        self._capture = capture
        self._release = weakref.finalize(self, capture.release) if capture is not None else None

    def __deepcopy__(self, memo) -> "CompressedCache":
        """An independent cache with the same contents (prompt reuse), sharing the model's forward capture."""
        dup = type(self).__new__(type(self))
        memo[id(self)] = dup
        for layer in self.layers:  # the model's config (what a windowed layer checks) is the model's, not copied
            config = getattr(layer, "attention_config", None)
            if config is not None:
                memo.setdefault(id(config), config)
        for key, value in self.__dict__.items():
            if key != "_release":
                setattr(dup, key, copy.deepcopy(value, memo))
        capture = self._capture
        dup._release = None
        if capture is not None:
            capture.retain()
            dup._release = weakref.finalize(dup, capture.release)
        return dup

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' update; after the last layer's, what the forward left on the device is read at once
        (`settle_step`): a step beyond fp16's range raises here, before the model returns its logits."""
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == len(self.layers) - 1:
            settle_step(self.layers)
        return out

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Remove this cache's claim on the model hooks (idempotent); the cache cannot be updated afterwards."""
        if self._release is not None:
            self._release()
        for layer in self.layers:
            layer.closed = True

    def __enter__(self) -> "CompressedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- operations that also touch the shared positions ---------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens; refused, before any layer changes, where a layer could not
        then hold what the next token reads (`LayerBase.crop_target`): with an fp16 window, use `checkpoint`
        and `rollback` instead."""
        targets = [layer.crop_target(tokens_to_remove) for layer in self.layers]  # every layer checked first
        for layer, target in zip(self.layers, targets):
            layer.crop_to(target)
        if self.positions is not None:
            self.positions.truncate(self.get_seq_length())

    def checkpoint(self) -> tuple:
        """A mark of the cache as it is now; `rollback(mark)` returns to it exactly, the fp16 window included,
        after any tokens were appended (a question and its answer asked of a context, draft tokens rejected)."""
        return tuple(layer.checkpoint() for layer in self.layers)

    def rollback(self, mark: tuple) -> None:
        """Return to `checkpoint()`'s state: every token appended since is dropped and the window tables are put
        back as they were. The rows must be those of the checkpoint (select them back first). Refused before
        any layer changes if a layer cannot (a sliding layer that dropped tokens since)."""
        if len(mark) != len(self.layers):
            raise ValueError(f"a checkpoint of {len(mark)} layers for a cache of {len(self.layers)}")
        for layer, m in zip(self.layers, mark):
            layer.check_rollback(m)
        for layer, m in zip(self.layers, mark):
            layer.rollback(m)
        if self.positions is not None:
            self.positions.truncate(self.get_seq_length())

    def reset(self) -> None:
        super().reset()
        if self.positions is not None:
            self.positions.clear()

    def _gather_positions(self, index: torch.Tensor) -> None:
        if self.positions is not None and len(self.positions):
            self.positions.gather_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._gather_positions(beam_idx)
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._gather_positions(indices.nonzero().view(-1) if indices.dtype == torch.bool else indices)
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._gather_positions(torch.arange(self.layers[0].batch_size).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)

    # ---- accounting ----------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Exact bytes held, by component (see `kvsqueeze.cache.report`)."""
        comps = dict.fromkeys(COMPONENTS, 0)
        capacity = 0
        for layer in self.layers:
            for name, n in layer.component_bytes().items():
                comps[name] += n
            capacity += layer.capacity_nbytes()
        if self.positions is not None:
            comps["positions"] += self.positions.nbytes
            capacity += self.positions.capacity_nbytes
        seq = self.get_seq_length()
        held = sum(layer.kept_tokens() for layer in self.layers)
        dynamic = sum(seq if h is None else h for h in held_by_layer([layer.window for layer in self.layers], seq))
        return MemoryReport(self.spec.name, self.shape.layers, self.layers[0].batch_size, seq, self.shape.channels,
                            comps, capacity, held, dynamic)


def cache_for(model, recipe: Recipe | str | Path | None = None,
              method: str | MethodSpec = DEFAULT_METHOD) -> CompressedCache:
    """A compressed KV cache for `model` that `model.generate(..., cache=cache)` fills.

    Args:
        model: a LLaMA-style transformers decoder (LLaMA, Mistral, Qwen2, SmolLM, ...).
        recipe: the model's calibration recipe (a `Recipe` or its directory);
            required by nuq and by per-channel int/nf keys.
        method: a method name (see `kvsqueeze.methods`) or a parsed `MethodSpec`; by default the 3.5-bit preset
            `q3.5`, chosen for 2,048 tokens and the tokens this model's layers hold (`preset_for`; `q3.5:ctx32k`
            spends its bits at 32K; README, "Which method").

    A method with an fp16 window of recent tokens (`:rN`) switches `model` to kvsqueeze's attention, which reads
    each query's own window and falls through to the model's own attention for everything else.

    Raises:
        MethodError: the method is not one the cache stores (the message lists those it does).
        RecipeError: no recipe, a recipe of another model, or one lacking this method's statistics.
        UnsupportedModelError: a model whose keys cannot be read before RoPE (`preflight`).
    """
    windows = model_windows(model)  # sliding-window layers keep what DynamicCache keeps
    # a preset's fp16 window follows the tokens this model's layers hold
    spec = preset_for(method, DEFAULT_CONTEXT, windows) if isinstance(method, str) else method
    check_supported(spec)
    simulating = getattr(model, SIMULATING, None)
    if simulating is not None:
        raise RuntimeError(f"a SimulatedQuantization of {simulating!r} is active on this model: its hooks would "
                           "quantize the keys and values before this cache does; leave its with-block first")
    shape = kv_shape(model.config)
    if isinstance(recipe, (str, Path)):
        recipe = Recipe.load(recipe)
    if recipe is not None:
        check_recipe(recipe, model)
    if not spec.quantized:
        layers = [Fp16Layer(w) for w in windows]
        for i, layer in enumerate(layers):
            layer.layer_idx = i
        return CompressedCache(layers, spec, shape, None, None)
    preflight(model)  # keys read where the model rotates them, or a clear refusal now
    attn = attention_modules(model)
    if len(attn) != shape.layers:
        raise ValueError(f"{type(model).__name__} has {len(attn)} attention modules for {shape.layers} layers; "
                         "kvsqueeze caches need one self-attention per layer")
    rotaries = layer_rotaries(model, shape.head_dim)
    device = next(model.parameters()).device
    positions = PositionLog(device)  # one for all full layers; a sliding layer drops tokens, and keeps its own
    stores = []
    for i in range(shape.layers):
        kq, vq = build_quantizers(spec, recipe, i, shape.channels)
        stores.append(KVStore(_to_device(kq, device), _to_device(vq, device), shape.channels, spec.sinks, device,
                              head_dim=shape.head_dim, positions=positions if windows[i] is None else None,
                              window=spec.window))
    capture = ForwardCapture.acquire(model)  # last, so that a failure above leaves no hooks behind
    layers = [CompressedLayer(s, i, rotaries[i], capture, windows[i]) for i, s in enumerate(stores)]
    for layer in layers:
        layer.method_name = spec.name
    if spec.window:  # each query of a forward reads its own fp16 window: kvsqueeze's attention does that
        register_handler(window_handler)
        switch_attention(model)
        for layer in layers:
            layer.attention_config = model.config
    return CompressedCache(layers, spec, shape, positions, capture)
