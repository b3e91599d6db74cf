"""kvsqueeze: KVQuant-style 2/3/4-bit KV-cache quantization for Hugging Face LLaMA-family models."""

__version__ = "0.1.0"

__all__ = ["__version__", "cache_for"]


def __getattr__(name: str):
    # Lazy, so that `import kvsqueeze` (and its numerics) does not pull in transformers.
    if name == "cache_for":
        from .cache.constructor import cache_for

        return cache_for
    raise AttributeError(f"module 'kvsqueeze' has no attribute {name!r}")
