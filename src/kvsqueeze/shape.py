"""The shape of a model's KV cache, read from its config (a transformers config object or its dict)."""

from __future__ import annotations

from dataclasses import dataclass


class ShapeError(ValueError):
    """A config without the sizes of a decoder's attention KV heads."""


@dataclass(frozen=True)
class KVShape:
    """What the KV cache of a model looks like."""

    layers: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (fewer than query heads in GQA models)
    head_dim: int

    @property
    def channels(self) -> int:
        """K (= V) channels per token and layer: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim


def kv_shape(config) -> KVShape:
    """KV-cache shape of a config: num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
    query heads) and head_dim (default: hidden_size // num_attention_heads).

    Raises:
        ShapeError: a size is missing or zero (not a decoder with multi-head or grouped-query attention).
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    layers = get("num_hidden_layers", 0) or 0
    heads = get("num_attention_heads", 0) or 0
    kv_heads = get("num_key_value_heads", None) or heads
    head_dim = get("head_dim", None) or ((get("hidden_size", 0) or 0) // heads if heads else 0)
    if not (layers and heads and kv_heads and head_dim):
        raise ShapeError(
            f"model config has layers={layers}, heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}: "
            "kvsqueeze needs a decoder with multi-head (or grouped-query) attention"
        )
    return KVShape(int(layers), int(heads), int(kv_heads), int(head_dim))
