"""Defaults of the compressed cache, shared by `cache_for` and the `kvsqueeze generate` command."""

from __future__ import annotations

DEFAULT_METHOD = "nuq3-1%"  # KVQuant's headline setting: about 3.3 bits per element, near-lossless
DEFAULT_MAX_NEW_TOKENS = 64
