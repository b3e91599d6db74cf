"""kvsqueeze: KVQuant-style 2/3/4-bit KV-cache quantization for Hugging Face decoder models.

Quickstart::

    import kvsqueeze

    model, tok = kvsqueeze.load_model("smollm2-135m")
    cache = kvsqueeze.cache_for(model, "out/recipe", "q3.5")
    with kvsqueeze.fused_decode(model, cache):
        out = model.generate(tok("Hello", return_tensors="pt").input_ids, cache=cache)

Names are imported on first use, so that `import kvsqueeze` (and its numerics)
does not pull in transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {  # name -> module that defines it
    "cache_for": ".integrations.cache",
    "CompressedCache": ".integrations.cache",
    "fused_decode": ".integrations.fused",
    "enable_fused_decode": ".integrations.fused",
    "load_model": ".integrations.loading",
    "SimulatedQuantization": ".integrations.simulate",
    "Recipe": ".recipe",
    "MethodSpec": ".methods",
    "parse_method": ".methods",
    "Backend": ".kernels",
    "decode_attention": ".kernels",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'kvsqueeze' has no attribute {name!r}")
