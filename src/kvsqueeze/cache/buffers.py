"""Growable token-major tensors: the one allocation policy of the compressed cache.

Every array of the cache grows along its first axis, one row per token (or per
outlier). Appending into spare capacity is a slice assignment; when capacity
runs out it doubles, so appending n rows costs amortized O(n) and a decode step
never copies the whole cache. `nbytes` counts the rows in use, `capacity_nbytes`
what is allocated (the slack is at most the size in use, plus a small minimum).
"""

from __future__ import annotations

import numpy as np
import torch

MIN_ROWS = 16  # first allocation; small enough that an empty cache costs nothing worth reporting


class GrowableTensor:
    """A tensor [rows, *row_shape] whose first axis grows by capacity doubling.

    Args:
        row_shape: shape of one row (may be empty for a 1-D array).
        dtype, device: of the storage.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._data = torch.empty((0, *self.row_shape), dtype=dtype, device=self.device)
        self.length = 0
        self._host: np.ndarray | None = None  # the allocation's numpy view (`host_rows`), until it changes

    def __len__(self) -> int:
        return self.length

    def view(self) -> torch.Tensor:
        """The rows in use, [length, *row_shape] (a view: do not keep it across appends)."""
        return self._data[: self.length]

    @property
    def storage(self) -> torch.Tensor:
        """The whole allocation, [capacity, *row_shape]: its first `length` rows are in use. It stays the same
        tensor until an append outgrows it (or `replace` / `astype` / `clear`)."""
        return self._data

    def __getstate__(self) -> dict:  # a copy makes its own view of its own allocation
        return {**self.__dict__, "_host": None}

    def host_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a CPU allocation as a numpy view, for a compiled encoder to write in place
        (16-bit floats as their int16 bits). The view of the allocation is made once, not on every call."""
        if self._host is None:
            if self.device.type != "cpu":
                raise ValueError(f"host_rows: numpy views are of CPU allocations, this one is on {self.device}")
            data = self._data.view(torch.int16) if self._data.dtype in (torch.float16, torch.bfloat16) else self._data
            self._host = data.numpy()
        return self._host[start:stop]

    def extend_host(self, n: int) -> np.ndarray:
        """Take n more rows in use, unwritten, and return them as a numpy view (`host_rows`) to write in place."""
        start = self.length
        self.extend(n)
        return self.host_rows(start, start + n)

    def append(self, rows: torch.Tensor) -> None:
        """Append rows [n, *row_shape] (cast to this buffer's dtype)."""
        if tuple(rows.shape[1:]) != self.row_shape:
            raise ValueError(f"rows of shape {tuple(rows.shape[1:])} appended to a buffer of rows {self.row_shape}")
        need = self.length + rows.shape[0]
        self._reserve(need)
        self._data[self.length : need] = rows
        self.length = need

    def _reserve(self, rows: int) -> None:
        if rows > self._data.shape[0]:
            grown = torch.empty((max(rows, 2 * self._data.shape[0], MIN_ROWS), *self.row_shape),
                                dtype=self.dtype, device=self.device)
            grown[: self.length] = self._data[: self.length]
            self._data, self._host = grown, None

    def extend(self, n: int) -> torch.Tensor:
        """Take n more rows in use, unwritten, and return the storage (for writes at offsets the device holds)."""
        need = self.length + n
        self._reserve(need)
        self.length = need
        return self._data

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows (capacity is kept for the next appends)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} rows to {length}")
        self.length = length

    def shrink(self, slack: int) -> None:
        """Give back an allocation more than twice the rows in use plus `slack` (room an encoder reserved for the
        worst case and did not use): the rows move to one of their own size, which the next appends grow."""
        if self._data.shape[0] > 2 * self.length + slack:
            self._data, self._host = self._data[: self.length].clone(), None

    def drop_front(self, rows: int) -> None:
        """Forget the first `rows` rows: the others move to the front of the same allocation."""
        if not 0 <= rows <= self.length:
            raise ValueError(f"cannot drop {rows} of {self.length} rows")
        if rows:
            self._data[: self.length - rows] = self._data[rows : self.length].clone()
            self.length -= rows

    def replace(self, rows: torch.Tensor) -> None:
        """Make `rows` [n, *row_shape'] the whole content (after a batch gather, the row shape may change)."""
        self.row_shape = tuple(rows.shape[1:])
        self._data, self._host = rows.to(self.dtype).contiguous(), None
        self.length = rows.shape[0]

    def astype(self, dtype: torch.dtype) -> None:
        """Convert the storage to a wider dtype (pointer arrays outgrowing int32)."""
        self.dtype = dtype
        self._data, self._host = self._data.to(dtype), None

    def clear(self) -> None:
        """Drop everything, capacity included."""
        self._data, self._host = torch.empty((0, *self.row_shape), dtype=self.dtype, device=self.device), None
        self.length = 0

    @property
    def row_nbytes(self) -> int:
        n = 1
        for s in self.row_shape:
            n *= s
        return n * self._data.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the rows in use."""
        return self.length * self.row_nbytes

    @property
    def capacity_nbytes(self) -> int:
        """Bytes allocated, spare capacity included."""
        return self._data.shape[0] * self.row_nbytes
