"""Decode attention over the compressed KV cache: one op (`decode_attention`), explicit backends (`Backend`)."""

from .api import (
    Backend,
    CompressedKV,
    Outliers,
    available_backends,
    decode_attention,
    decode_attention_store,
    resolve_backend,
)
from .rope import Rope

__all__ = ["Backend", "CompressedKV", "Outliers", "Rope", "available_backends", "decode_attention",
           "decode_attention_store", "resolve_backend"]
