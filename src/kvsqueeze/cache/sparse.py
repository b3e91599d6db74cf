"""Sparse outliers compressed along the token axis: KVQuant's CSC keys and CSR values.

KVQuant (Hooper et al., arXiv 2401.18079, Section 3.7) keeps the dense-and-sparse
outliers of keys in CSC form (keys are stored [channels, tokens], so a new token
is a new column) and those of values in CSR form (values are [tokens, channels],
a new token is a new row). Both are the same structure seen from the token: per
token, a run of (channel index, fp16 value) pairs, located by a pointer array
with one entry per token. `TokenOutliers` is that structure; the cache holds
one for keys (read as CSC of K^T) and one for values (CSR of V).

Layout (all three arrays grow by capacity doubling, see `buffers.py`):

* `pointers` int32 [tokens + 1], `pointers[0] = 0`: the outliers of token n
  are entries `pointers[n] : pointers[n + 1]`. 32 bits as
  `storage.tensor_bytes` counts them; promoted to int64 if one array ever passes 2^31 - 1
  outliers.
* `channels` int16 [nnz]: channel index in [0, C). Indices 32,768..65,535 are
  kept as their 16-bit pattern (read back with `& 0xFFFF`).
* `values` fp16 [nnz].

Entries of one token are in increasing channel order, so a structure built by
appends is identical to one built at once (`from_dense`).

Fixed-count rows (`fixed=k`): per-token value outliers are the exact top-k
above and below, so every token has the same number of entries and the row
pointers are implicit (`pointers[n] = n * k`) instead of stored. A token with
fewer outliers (a sink slot) is padded with exact values of its first
non-outlier channels; storing a value exactly never changes what a sink reads.

Appending without waiting for the device (`append_unsettled`, a decode step):
how many outliers the new tokens have is known only on the device, and reading
it would stall a GPU at every layer of every step. The entries are written at
the offset the device's last pointer gives, into room for N * C of them; the
arrays' length on the host is then an upper bound, and the entries past
`pointers[tokens]` are not outliers. `settle` reads the true count and drops
the rest (the cache does it once per forward for all its layers).
"""

from __future__ import annotations

import torch

from .buffers import GrowableTensor

MAX_CHANNELS = 1 << 16  # channel indices are 16 bits
MIN_SLACK = 1 << 16  # room past the outliers that `append_unsettled` may leave before it settles by itself
_INT32_MAX = (1 << 31) - 1


def _to_int16_pattern(channels: torch.Tensor) -> torch.Tensor:
    return torch.where(channels >= 1 << 15, channels - (1 << 16), channels).to(torch.int16)


class TokenOutliers:
    """Outliers of a stream of tokens, C channels each; see the module docstring.

    Args:
        channels: C, the width of one token's vector (at most 65,536).
        device: where the arrays live.
    """

    def __init__(self, channels: int, device: torch.device | str = "cpu", fixed: int | None = None):
        if not 0 < channels <= MAX_CHANNELS:
            raise ValueError(f"outlier channel indices are 16 bits: vectors of 1..{MAX_CHANNELS} channels, "
                             f"got {channels}")
        self.width = channels
        self.device = torch.device(device)
        self.fixed = fixed  # entries per token when row pointers are implicit
        self._tokens = 0
        self._loose = 0  # entries `append_unsettled` made room for since the last `settle`
        self.pointers = GrowableTensor((), torch.int32, self.device)
        self.channels = GrowableTensor((), torch.int16, self.device)
        self.values = GrowableTensor((), torch.float16, self.device)
        self.pointers.append(torch.zeros(1, dtype=torch.int32, device=self.device))

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, mask: torch.Tensor, x: torch.Tensor) -> TokenOutliers:
        """Build at once from mask [N, C] (bool, True = outlier) and values x [N, C]."""
        out = cls(mask.shape[1], mask.device)
        out.append(mask, x)
        return out

    def append(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Append N tokens: mask [N, C] bool marks the outliers, x [N, C] holds their exact values.

        Returns the mask of the entries stored: `mask`, plus the padding entries of fixed-count rows (a row of
        more than `fixed` marks keeps its lowest `fixed` channels)."""
        self._check(mask, x)
        self._tokens += mask.shape[0]
        if self.fixed is not None:
            # every row's first `fixed` channels once its marks are sorted first: its marks, then its first
            # unmarked channels as padding; the same shapes whatever the marks, so nothing waits for the device
            cols = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, : self.fixed]
            cols = cols.sort(dim=1).values  # [N, fixed], channels ascending
            self.channels.append(_to_int16_pattern(cols).reshape(-1))
            self.values.append(x.gather(1, cols).to(torch.float16).reshape(-1))
            return torch.zeros_like(mask).scatter_(1, cols, True)
        self.settle()
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: token by token, channels ascending
        ends = self.nnz + mask.sum(dim=1, dtype=torch.int64).cumsum(0)
        if ends.numel() and int(ends[-1]) > _INT32_MAX and self.pointers.dtype == torch.int32:
            self.pointers.astype(torch.int64)
        self.pointers.append(ends.to(self.pointers.dtype))
        self.channels.append(_to_int16_pattern(cols))
        self.values.append(x[rows, cols].to(torch.float16))
        return mask

    def append_unsettled(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`append` without reading anything from the device (see the module docstring): the arrays grow by
        N * C entries until `settle`. For the few tokens of a decode step; returns `mask`."""
        if self.fixed is not None:  # a count the host knows
            return self.append(mask, x)
        self._check(mask, x)
        n, c = mask.shape
        if self._loose > max(MIN_SLACK, len(self.values) - self._loose):
            self.settle()  # outliers nobody settles (a store used without a cache) take at most twice their room
        if len(self.values) + n * c > _INT32_MAX and self.pointers.dtype == torch.int32:
            self.pointers.astype(torch.int64)
        start = self.pointers.view()[-1:].long()  # [1], the true count, on the device
        self.pointers.append((start + mask.sum(dim=1, dtype=torch.int64).cumsum(0)).to(self.pointers.dtype))
        self._tokens += n
        # element i of the flattened mask goes to start + its rank among the outliers, or after all of them
        flat = mask.reshape(-1)
        before = flat.cumsum(0)  # outliers up to element i, i included
        i = torch.arange(n * c, device=mask.device)
        at = start + torch.where(flat, before - 1, before[-1:] + i - before)
        self.channels.extend(n * c).index_copy_(0, at, _to_int16_pattern(i % c))
        self.values.extend(n * c).index_copy_(0, at, x.reshape(-1).to(torch.float16))
        self._loose += n * c
        return mask

    def reserve(self, tokens: int, entries: int):
        """Room on the CPU for `tokens` more tokens of up to `entries` entries, for an encoder that writes them in
        place (`kernels.numba.encode`): (their row pointers as a numpy view, None for fixed-count rows; channels
        int16 and values as fp16 bit patterns int16, numpy views of `entries`; the entries before them). End it
        with `commit`."""
        if self.device.type != "cpu":
            raise ValueError("TokenOutliers.reserve writes numpy views: a CPU store's")
        self.settle()  # on the CPU the true count costs nothing to read
        base = len(self.values)
        if base + entries > _INT32_MAX and self.pointers.dtype == torch.int32:
            self.pointers.astype(torch.int64)
        pointers = None if self.fixed is not None else self.pointers.extend_host(tokens)
        return pointers, self.channels.extend_host(entries), self.values.extend_host(entries), base

    def commit(self, tokens: int, base: int, entries: int) -> None:
        """End a `reserve` that returned `base`: the new tokens hold the first `entries` entries of its room."""
        self._tokens += tokens
        for arr in (self.channels, self.values):
            arr.truncate(base + entries)
            arr.shrink(MIN_SLACK)  # the room reserved for every element (a prompt's: N * C) is not kept

    def settle(self, nnz: int | None = None) -> None:
        """Drop the room `append_unsettled` left past the outliers; `nnz`: their count, when already read."""
        if not self._loose:
            return
        nnz = int(self.pointers.view()[-1]) if nnz is None else nnz
        self.channels.truncate(nnz)
        self.values.truncate(nnz)
        self._loose = 0

    def device_nnz(self) -> torch.Tensor:
        """The outliers' true count, int [1] on the device (read it to `settle`)."""
        return self.pointer_view()[-1:]

    @property
    def unsettled(self) -> bool:
        """Whether the arrays hold room past the outliers (`append_unsettled`) that `settle` has not dropped."""
        return self._loose > 0

    def _check(self, mask: torch.Tensor, x: torch.Tensor) -> None:
        if mask.dim() != 2 or mask.shape[1] != self.width or x.shape != mask.shape:
            raise ValueError(f"expected mask and values of shape [N, {self.width}], got {tuple(mask.shape)} "
                             f"and {tuple(x.shape)}")

    def append_rows(self, channels: torch.Tensor, values: torch.Tensor) -> None:
        """Append N fixed-count rows given as channels int16 [N, fixed] (ascending, 16-bit patterns) and their
        fp16 values [N, fixed], as a fused encoder writes them."""
        shape = tuple(channels.shape)
        if self.fixed is None or shape != tuple(values.shape) or len(shape) != 2 or shape[1] != self.fixed:
            raise ValueError(f"append_rows takes [N, {self.fixed}] channels and values of fixed-count rows, got "
                             f"{tuple(channels.shape)} and {tuple(values.shape)}")
        self._tokens += channels.shape[0]
        self.channels.append(channels.reshape(-1))
        self.values.append(values.reshape(-1))

    def pointer_view(self) -> torch.Tensor:
        """Row pointers [tokens + 1]; implicit ones written out (int32 while the entries fit, as stored ones are)."""
        if self.fixed is not None:
            n = self._tokens + 1
            dtype = torch.int32 if (n - 1) * self.fixed <= _INT32_MAX else torch.int64
            return torch.arange(n, device=self.device, dtype=dtype) * self.fixed
        return self.pointers.view()

    @property
    def storages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The allocations of pointers, channels and values (see `GrowableTensor.storage`)."""
        return self.pointers.storage, self.channels.storage, self.values.storage

    # ---- size ----------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def nnz(self) -> int:
        """Outliers held (settled first: it may read their count from the device)."""
        self.settle()
        return len(self.values)

    @property
    def entries(self) -> int:
        """Entries of the arrays in use: the outliers, and until `settle` the room past them."""
        return len(self.values)

    def counts(self) -> torch.Tensor:
        """Outliers per token, int64 [tokens]."""
        return self.pointer_view().long().diff()

    # ---- editing -------------------------------------------------------------------------
    def truncate(self, tokens: int) -> None:
        """Keep the first `tokens` tokens."""
        if not 0 <= tokens <= self.tokens:
            raise ValueError(f"cannot keep {tokens} of {self.tokens} tokens")
        nnz = int(self.pointer_view()[tokens])
        if self.fixed is None:
            self.pointers.truncate(tokens + 1)
        self._tokens = tokens
        self.channels.truncate(nnz)
        self.values.truncate(nnz)
        self._loose = 0

    def select(self, order: torch.Tensor) -> None:
        """Keep tokens `order` [N'] (int64 indices into the current tokens, repeats allowed), in that order."""
        ptr = self.pointer_view().long()
        counts = ptr.diff()[order]
        starts = ptr[:-1][order]
        total = int(counts.sum())
        new_starts = counts.cumsum(0) - counts
        within = torch.arange(total, device=self.device) - new_starts.repeat_interleave(counts)
        entries = starts.repeat_interleave(counts) + within
        self.channels.replace(self.channels.view()[entries])
        self.values.replace(self.values.view()[entries])
        self._tokens = order.numel()
        self._loose = 0
        if self.fixed is not None:
            return
        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        dtype = torch.int64 if total > _INT32_MAX else torch.int32
        self.pointers.dtype = dtype
        self.pointers.replace(torch.cat([head, counts.cumsum(0)]).to(dtype))

    def clear(self) -> None:
        self._tokens = self._loose = 0
        for buf in (self.pointers, self.channels, self.values):
            buf.clear()
        self.pointers.append(torch.zeros(1, dtype=self.pointers.dtype, device=self.device))

    # ---- reading -------------------------------------------------------------------------
    def token_index(self) -> torch.Tensor:
        """Token of each stored outlier, int64 [nnz]."""
        counts = self.counts()
        return torch.arange(counts.numel(), device=self.device).repeat_interleave(counts)

    def channel_index(self) -> torch.Tensor:
        """Channel of each stored outlier, int64 [nnz]."""
        self.settle()
        return self.channels.view().long() & 0xFFFF

    def scatter_into(self, dense: torch.Tensor) -> torch.Tensor:
        """Overwrite dense [tokens, C] at the outliers with their fp16 values (in dense's dtype); returns dense."""
        if self.nnz:
            dense[self.token_index(), self.channel_index()] = self.values.view().to(dense.dtype)
        return dense

    # ---- bytes ---------------------------------------------------------------------------
    @property
    def value_nbytes(self) -> int:
        self.settle()
        return self.values.nbytes

    @property
    def index_nbytes(self) -> int:
        self.settle()
        return self.channels.nbytes

    @property
    def pointer_nbytes(self) -> int:
        return 0 if self.fixed is not None else self.pointers.nbytes

    @property
    def pointer_itemsize(self) -> int:
        return 0 if self.fixed is not None else self.pointers.row_nbytes

    @property
    def capacity_nbytes(self) -> int:
        return self.pointers.capacity_nbytes + self.channels.capacity_nbytes + self.values.capacity_nbytes
