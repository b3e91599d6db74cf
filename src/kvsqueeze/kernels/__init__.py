"""Decode attention over the compressed KV cache: one op (`decode_attention`), explicit backends (`Backend`)."""

from ..numerics.rope import Rope
from .api import Backend, available_backends, decode_attention, dequantize_view, resolve_backend
from .view import Outliers, StoreView

__all__ = ["Backend", "Outliers", "Rope", "StoreView", "available_backends", "decode_attention", "dequantize_view",
           "resolve_backend"]
