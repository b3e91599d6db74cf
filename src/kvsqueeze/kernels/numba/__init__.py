"""The numba backend of `kvsqueeze.kernels.decode_attention`: the fused CPU kernel (see `attend.py`), and the
whole cache dequantized in one compiled pass (`dequant.py`)."""

from ...numba_cache import install

install()  # before any kernel is defined: their cache entries then follow every file of this directory

from .attend import KernelInputs, decode_attention, kernel_inputs, work_ranges  # noqa: E402
from .dequant import dequantize_view  # noqa: E402

__all__ = ["KernelInputs", "decode_attention", "dequantize_view", "kernel_inputs", "work_ranges"]
