"""The numba backend of `kvsqueeze.kernels.decode_attention`: the fused CPU kernel (see `attend.py`)."""

from .attend import KernelInputs, decode_attention, kernel_inputs, work_ranges

__all__ = ["KernelInputs", "decode_attention", "kernel_inputs", "work_ranges"]
