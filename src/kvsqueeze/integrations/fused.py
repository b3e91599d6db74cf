"""Fused decode attention inside `generate()`: glue between `CompressedCache` and `kvsqueeze.kernels`.

Usage::

    cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
    with fused_decode(model, cache):  # or handle = enable_fused_decode(...); ...; handle.close()
        out = model.generate(ids, cache=cache, max_new_tokens=64)

How a decode step reaches the kernel without forking a model file:

* each `CompressedLayer` of the cache is given a decode backend. When one new
  token arrives (query length 1) it compresses it as usual but, instead of
  dequantizing the whole cache, returns empty [B, H, 0, D] tensors that carry
  the layer (`CompressedLayer.decode_marker`);
* the model is switched to the "kvsqueeze" attention implementation
  (`attention.py`), whose handler here recognises the marker and calls
  `kernels.decode_attention` on the layer's store view. The marker names its
  own layer, so several caches (or a `DynamicCache`) can be used with the same
  model.

The hot path, from the attention function to the kernel: `kvsqueeze_attention`
-> `fused_attention` -> `kernels.decode_attention` -> the backend's
`decode_attention`. Prefill (query length > 1) keeps the dense path:
dequantize, then SDPA.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels import Backend, decode_attention, resolve_backend
from ..kernels.mixed import causal_bool_mask
from .attention import register_handler, switch_attention
from .layers import MARKER, CompressedLayer


def fused_attention(module, query: torch.Tensor, key, value, attention_mask, scaling: float | None, **kwargs):
    """The "kvsqueeze" attention handler: a decode step whose key is a layer's marker, else None.

    Returns:
        ([B, 1, Hq, D] in query's dtype, None), what an attention implementation returns: attention of
        query [B, Hq, 1, D] over the layer's compressed cache.
    """
    layer = getattr(key, MARKER, None)
    if layer is None:
        return None
    b, _, q_len, d = query.shape
    if q_len != 1:
        raise RuntimeError(f"fused decode attention got a query of length {q_len}; it attends one new token")
    t = layer.store.tokens
    key_mask = None
    if attention_mask is not None:
        key_mask = causal_bool_mask(attention_mask, 1, t, query.device)[:, 0, 0, :].expand(b, t)
    out = decode_attention(query[:, :, 0, :].float(), layer.store.view(), layer.rope,
                           scaling if scaling is not None else d**-0.5, key_mask, layer.decode_backend,
                           softcap=kwargs.get("softcap"), sink_logits=kwargs.get("s_aux"))  # [B, Hq, D]
    return out.to(query.dtype).unsqueeze(1), None


class FusedDecode:
    """The switch `enable_fused_decode` returns: `close()` (or leaving its `with` block) restores the dense path."""

    def __init__(self, model, cache, backend: Backend):
        self.model, self.cache, self.backend = model, cache, backend
        register_handler(fused_attention)
        self._saved_attn = switch_attention(model)
        self.layers = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
        for layer in self.layers:
            layer.decode_backend = backend
            layer.attention_config = model.config  # each step checks the model still runs kvsqueeze's attention
        self.closed = False

    def close(self) -> None:
        """Give the cache's layers and the model back their dense path (idempotent)."""
        if self.closed:
            return
        for layer in self.layers:
            layer.decode_backend = None
        self.model.set_attn_implementation(self._saved_attn)
        self.closed = True

    def __enter__(self) -> FusedDecode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enable_fused_decode(model, cache, backend: Backend | str = Backend.AUTO) -> FusedDecode:
    """Make `model.generate(..., cache=cache)` run its decode steps through the fused kernel.

    Args:
        model: the model `cache` was built for (`kvsqueeze.cache_for`).
        cache: a `CompressedCache` of a quantized method (fp16 caches have no compressed store to read).
        backend: a `kernels.Backend` or its name; "auto" takes the fastest for the cache's device.

    Returns:
        A `FusedDecode` handle; call `close()` to go back to dense attention.
    """
    layers = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, CompressedLayer)]
    if not layers:
        raise ValueError("fused decode reads the compressed store of a CompressedCache built by "
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
