"""The Triton backend of `kvsqueeze.kernels.decode_attention`: the fused GPU kernels (see `attend.py`)."""

from .attend import decode_attention, interpreting

__all__ = ["decode_attention", "interpreting"]
