"""Fused decode attention inside `generate()`: glue between `KVQuantCache` and `kvsqueeze.kernels`.

Usage::

    cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
    with fused_decode(model, cache):  # or handle = enable_fused_decode(...); ...; handle.close()
        out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

How a decode step reaches the kernel without forking a model file:

* each `KVQuantLayer` of the cache is replaced by a `FusedDecodeLayer` sharing
  its store. When one new token arrives (query length 1) it compresses it as
  usual but, instead of dequantizing the whole cache, returns an empty
  [B, H, 0, D] tensor that carries the layer (`MARKER`);
* the model is switched to the "kvsqueeze" attention implementation
  (`attention.py`), which recognises that marker and calls
  `kernels.decode_attention_store` on the layer's store, positions and rotary
  embedding. The marker names its own layer, so several caches (or a
  `DynamicCache`) can be used with the same model.

Prefill (query length > 1) keeps the dense path: dequantize, then SDPA.
"""

from __future__ import annotations

import contextlib

import torch

from ..cache.layer import KVQuantLayer
from ..kernels import Backend, Rope, decode_attention_store, resolve_backend
from .attention import ATTN_NAME, causal_bool_mask, register_attention
from .modules import attention_modules

MARKER = "kvsqueeze_fused_layer"  # attribute of the empty key tensor a decode step returns


class FusedDecodeLayer(KVQuantLayer):
    """A `KVQuantLayer` whose decode steps hand attention the compressed store instead of dense K/V.

    Build with `wrap`; it shares every piece of state (store, positions, hooks) with the wrapped layer.
    """

    backend: Backend
    _decoding: bool = False

    @classmethod
    def wrap(cls, layer: KVQuantLayer, backend: Backend) -> FusedDecodeLayer:
        fused = cls.__new__(cls)
        fused.__dict__.update(layer.__dict__)
        fused.backend = backend
        return fused

    def unwrap(self) -> KVQuantLayer:
        """A plain `KVQuantLayer` over the same state."""
        plain = KVQuantLayer.__new__(KVQuantLayer)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("backend", "_decoding")})
        return plain

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Compress the new tokens; for a single token return (marker, marker) instead of the whole cache."""
        self._decoding = key_states.shape[-2] == 1
        try:
            return super().update(key_states, value_states, *args, **kwargs)
        finally:
            self._decoding = False

    def read(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._decoding:
            return super().read(dtype)
        marker = torch.empty(self.store.batch, self.heads, 0, self.head_dim, dtype=dtype or self.dtype,
                             device=self.store.device)
        setattr(marker, MARKER, self)
        return marker, marker


def fused_layer_of(key) -> FusedDecodeLayer | None:
    """The layer a decode step's marker key names, or None for ordinary keys."""
    return getattr(key, MARKER, None)


def fused_decode_attention(layer: FusedDecodeLayer, query: torch.Tensor, attention_mask,
                           scaling: float | None) -> tuple[torch.Tensor, None]:
    """Attention of query [B, Hq, 1, D] over the layer's compressed cache, in transformers' output layout.

    Returns:
        ([B, 1, Hq, D] in query's dtype, None): what an attention implementation returns.
    """
    b, _, q_len, d = query.shape
    if q_len != 1:
        raise RuntimeError(f"fused decode attention got a query of length {q_len}; it attends one new token")
    t = layer.store.tokens
    key_mask = None
    if attention_mask is not None:
        key_mask = causal_bool_mask(attention_mask, 1, t, query.device)[:, 0, 0, :].expand(b, t)
    scaling = scaling if scaling is not None else d**-0.5
    out = decode_attention_store(query[:, :, 0, :].float(), layer.store, layer.log, layer.heads, layer.head_dim,
                                 _rope(layer.rotary), scaling, key_mask, layer.backend)  # [B, Hq, D]
    return out.to(query.dtype).unsqueeze(1), None


_ROPES: dict[int, tuple] = {}  # id(rotary module) -> (its frequency tensor, that tensor's version, `Rope`)


def _rope(rotary) -> Rope:
    """`Rope.from_rotary`, read again only when the module's frequencies are another tensor or were modified."""
    freq = getattr(rotary, "inv_freq", None)
    hit = _ROPES.get(id(rotary))
    if hit is not None and freq is not None and hit[0] is freq and hit[1] == freq._version:
        return hit[2]
    rope = Rope.from_rotary(rotary)
    if len(_ROPES) > 256:
        _ROPES.clear()
    if not freq.is_inference():
        _ROPES[id(rotary)] = (freq, freq._version, rope)
    return rope


class FusedDecode:
    """The switch `enable_fused_decode` returns: `close()` (or leaving its `with` block) restores the dense path."""

    def __init__(self, model, cache, backend: Backend):
        self.model, self.cache, self.backend = model, cache, backend
        self._saved_attn = model.config._attn_implementation
        register_attention()
        model.set_attn_implementation(ATTN_NAME)
        for module in attention_modules(model):
            module.kvsqueeze_fused = backend  # tag: this module's decode steps may take the fused path
        cache.layers = [FusedDecodeLayer.wrap(layer, backend) if type(layer) is KVQuantLayer else layer
                        for layer in cache.layers]
        self.closed = False

    def close(self) -> None:
        """Unwrap the cache's layers and give the model back its previous attention implementation (idempotent)."""
        if self.closed:
            return
        self.cache.layers = [layer.unwrap() if isinstance(layer, FusedDecodeLayer) else layer
                             for layer in self.cache.layers]
        for module in attention_modules(self.model):
            if hasattr(module, "kvsqueeze_fused"):
                del module.kvsqueeze_fused
        self.model.set_attn_implementation(self._saved_attn)
        self.closed = True

    def __enter__(self) -> FusedDecode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enable_fused_decode(model, cache, backend: Backend | str = Backend.AUTO) -> FusedDecode:
    """Make `model.generate(..., past_key_values=cache)` run its decode steps through the fused kernel.

    Args:
        model: the model `cache` was built for (`kvsqueeze.cache_for`).
        cache: a `KVQuantCache` of a quantized method (fp16 caches have no compressed store to read).
        backend: a `kernels.Backend` or its name; "auto" takes the fastest for the cache's device.

    Returns:
        A `FusedDecode` handle; call `close()` to go back to dense attention.
    """
    layers = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, KVQuantLayer)]
    if not layers:
        raise ValueError("fused decode reads the compressed store of a KVQuantCache built by "
                         "`kvsqueeze.cache_for` with a quantized method (e.g. 'nuq3-1%'); this cache has none")
    return FusedDecode(model, cache, resolve_backend(backend, layers[0].store.device))


@contextlib.contextmanager
def fused_decode(model, cache, backend: Backend | str = Backend.AUTO):
    """Context manager form of `enable_fused_decode`."""
    handle = enable_fused_decode(model, cache, backend)
    try:
        yield handle
    finally:
        handle.close()
