"""Linear layers that read their weights once per call when they multiply a few rows, on a CPU.

A decode step multiplies one row (or a few: a batch of questions) by every
weight matrix of the model. PyTorch's `linear` computes ``x @ W.T``, and with
a few rows the CPU BLAS either runs a matrix-vector product that does not
reach the memory bandwidth or repacks ``W`` on every call. Computing
``(W @ x.T).T`` instead streams ``W`` as it lies; with a single row, a second
(copied) row keeps BLAS on its matrix-matrix path. Measured with 2 threads
(AMD EPYC) for Qwen2.5-Coder-0.5B's output layer (151,936 x 896, fp32): one
row 48 -> 18 ms, three rows 164 -> 28 ms. The numbers are the same sums in
another order: results agree with `linear` to float rounding.

The long-context evaluations use it while they answer questions
(`ruler_eval`): there the model's weights, not the KV cache, are what each
generated token costs.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

MAX_ROWS = 16  # above this, BLAS's own path for `linear` is as fast


def _skinny_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or x.dtype != self.weight.dtype:
        return nn.Linear.forward(self, x)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()
    out = (self.weight @ flat.t()).t()[:rows].contiguous()
    if self.bias is not None:
        out += self.bias
    return out.view(*x.shape[:-1], self.weight.shape[0])


@contextlib.contextmanager
def skinny_linears(model: nn.Module):
    """Inside the block, `model`'s fp32 `nn.Linear` layers on the CPU compute few-row inputs as ``(W @ x.T).T``.

    Other layers (another dtype or device, subclasses with their own forward) are left as they are; leaving the
    block restores every layer's own forward.
    """
    changed = []
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32 and "forward" not in vars(module)):
            module.forward = types.MethodType(_skinny_forward, module)
            changed.append(module)
    try:
        yield model
    finally:
        for module in changed:
            del module.forward
