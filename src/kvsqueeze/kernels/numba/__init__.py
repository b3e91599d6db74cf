"""The numba backend of `kvsqueeze.kernels.decode_attention`: the fused CPU kernel (see `attend.py`)."""

from ...numba_cache import install

install()  # before any kernel is defined: their cache entries then follow every file of this directory

from .attend import KernelInputs, decode_attention, kernel_inputs, work_ranges  # noqa: E402

__all__ = ["KernelInputs", "decode_attention", "kernel_inputs", "work_ranges"]
