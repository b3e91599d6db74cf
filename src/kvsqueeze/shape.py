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


def kv_shape(config, where: str = "model config") -> KVShape:
    """KV-cache shape of a config: layers = num_hidden_layers; kv_heads = num_key_value_heads (default: the
    query heads, plain multi-head attention); head_dim = head_dim if given, else hidden_size //
    num_attention_heads. A dict whose language model sits under `text_config` is read from there.

    Args:
        config: a transformers config or a config.json's dict.
        where: what the config is, for the error messages.

    Raises:
        ShapeError: a size is missing, not a positive integer, or inconsistent.
    """
    if isinstance(config, dict) and "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    get = _getter(config)
    layers = _positive_int(get, "num_hidden_layers", where)
    heads = _positive_int(get, "num_attention_heads", where)
    kv_heads = _positive_int(get, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ShapeError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                         f"({kv_heads}); fix the config (GQA shares each KV head among a whole number of query heads)")
    if get("head_dim") is not None:
        head_dim = _positive_int(get, "head_dim", where)
    else:
        hidden = _positive_int(get, "hidden_size", where)
        if hidden % heads:
            raise ShapeError(f"{where}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                             "and no head_dim is given; add \"head_dim\" to the config")
        head_dim = hidden // heads
    return KVShape(layers, heads, kv_heads, head_dim)


def _getter(config):
    return config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)


def positive_int(config, key: str, where: str = "model config", default: int | None = None) -> int:
    """config[key] (a dict's item or a config's attribute), which must be a positive integer (or absent, with a
    default)."""
    return _positive_int(_getter(config), key, where, default)


def _positive_int(get, key: str, where: str, default: int | None = None) -> int:
    value = get(key)
    if value is None:
        if default is not None:
            return default
        raise ShapeError(f"{where}: {key!r} is missing; kvsqueeze needs a decoder with multi-head (or "
                         "grouped-query) attention, whose config sets it")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShapeError(f"{where}: {key!r} must be a positive integer, got {value!r}; "
                         "fix the config or pass a built-in model name")
    return value


def context_length(config) -> int | None:
    """The model's context in tokens (`max_position_embeddings` of its text config: a multimodal config keeps it
    under `text_config`), None where the config names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None
