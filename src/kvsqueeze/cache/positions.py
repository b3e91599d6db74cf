"""The RoPE position of every cached token, shared by the stores of all layers of one cache.

RoPE is re-applied at read time (keys are stored before it), with the positions
the model used: with left padding, generate() shifts each row so that its first
real token is position 0. They are kept once per cache, int32 per token and
row, and counted in the memory report.
"""

from __future__ import annotations

import torch

from .buffers import GrowableTensor


class PositionLog:
    """Positions int32 [T, B], written by the first layer of each forward (the others find them written)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.buf = GrowableTensor((0,), torch.int32, device)

    def __len__(self) -> int:
        return len(self.buf)

    def view(self) -> torch.Tensor:
        """The positions in use, int32 [T, B]."""
        return self.buf.view()

    @property
    def storage(self) -> torch.Tensor:
        """The whole allocation, int32 [capacity, B] (see `GrowableTensor.storage`)."""
        return self.buf.storage

    def write(self, start: int, positions: torch.Tensor) -> None:
        """Positions [B, T] of the tokens at slots start..start+T (a no-op when another layer wrote them)."""
        t = positions.shape[-1]
        if start + t <= len(self.buf):  # every layer of a forward gets the same positions: not compared, which
            return  # would wait for the device in every layer
        rows = positions.t().to(torch.int32)  # [T, B]
        if start > len(self.buf):
            raise RuntimeError(f"positions written at slot {start} of a log of {len(self.buf)}: layers out of step")
        if self.buf.row_shape != tuple(rows.shape[1:]):
            if start:
                raise RuntimeError(f"batch of {rows.shape[1]} rows written into a cache of {self.buf.row_shape[0]}; "
                                   "change the batch with reorder_cache / batch_select_indices")
            self.buf = GrowableTensor(tuple(rows.shape[1:]), torch.int32, self.buf.device)
        self.buf.truncate(start)
        self.buf.append(rows)

    def truncate(self, tokens: int) -> None:
        self.buf.truncate(min(tokens, len(self.buf)))

    def drop_front(self, tokens: int) -> None:
        self.buf.drop_front(tokens)

    def gather_rows(self, index: torch.Tensor) -> None:
        self.buf.replace(self.buf.view().index_select(1, index.to(self.buf.device).long()))

    def clear(self) -> None:
        self.buf.clear()

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    @property
    def capacity_nbytes(self) -> int:
        return self.buf.capacity_nbytes
