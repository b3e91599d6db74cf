"""The contract between the compressed cache and the decode kernels: `StoreView` and its `Outliers`.

A layer's store (`kvsqueeze.cache.store.KVStore`) builds this view and keeps it
current; kernels read nothing else of the store. The token-major arrays are
the store's own allocations, which grow by capacity doubling: only their first
`tokens` rows (and the first `nnz` outlier entries) are in use, so a view costs
no copy and no slicing, and between two reallocations every view of a store
holds the very same tensors. `trim()` cuts every array to the rows in use.

Slots: slot n = t * B + b is token t of batch row b.

Rows (`StoreView.rows`): a view may instead point into paged storage in place
(`kvsqueeze.paged.layout`): the arrays are then flat views of the whole page
buffer, and `Rows` says where each slot's data lies in it (slot id s = page *
2**shift + offset in the page; array f's data of slot s starts at element
(s >> shift) * page[f] + (s & (2**shift - 1)) * width[f] + offset[f]). A
backend that reads rows attends over the pages without a copy; `gathered()`
copies them into the token-major form for the others.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Outliers(NamedTuple):
    """Sparse exact values per slot: CSC of K^T for keys, CSR of V for values.

    An outlier *replaces* the dequantized element at its channel.

    Attributes:
        pointers: int32 or int64 [>= slots + 1]: the entries of slot n are pointers[n] : pointers[n + 1].
            None when `fixed` is set: then pointers[n] = n * fixed.
        channels: int16 [>= nnz], the 16-bit pattern of a channel in [0, C) (read back with `& 0xFFFF`), or
            `NO_CHANNEL`: an empty entry, which every backend skips (a fixed count of entries per slot of which a
            page holds fewer: a rank's share of a token whose exact elements lie partly in other ranks' heads).
        values: fp16 [>= nnz].
        nnz: entries in use. With pointers, those past pointers[slots] are no outliers: room a decode step left
            (`TokenOutliers.append_unsettled`), since counting them would wait for the device.
        fixed: k when every slot holds exactly k entries (backends may then vectorize over slots);
            None: counts vary.
        code: the code every outlier's element holds in the packed codes (backends may then take the
            element it replaces without reading the codes); None: any code.
    """

    pointers: torch.Tensor | None
    channels: torch.Tensor
    values: torch.Tensor
    nnz: int
    fixed: int | None = None
    code: int | None = None

    def trim(self, slots: int) -> Outliers:
        """The entries in use, with implicit pointers written out: pointers [slots + 1], channels/values [nnz]."""
        pointers = self.pointers
        if self.fixed is not None and pointers is None:
            dtype = torch.int32 if slots * self.fixed < 1 << 31 else torch.int64
            pointers = torch.arange(slots + 1, dtype=dtype, device=self.values.device) * self.fixed
        return self._replace(pointers=pointers[: slots + 1], channels=self.channels[: self.nnz],
                             values=self.values[: self.nnz])


NO_CHANNEL = 0xFFFF  # an outlier entry that names no channel (see `Outliers.channels`)

ARRAYS = ("k_codes", "v_codes", "v_scale_zero", "k_channels", "k_values", "v_channels", "v_values")


class Rows(NamedTuple):
    """Where each slot of a view lies in paged storage; see the module docstring.

    Attributes:
        slots: int32 [B, >= T], the slot id of token t of batch row b (a masked token's must hold finite data:
            a slot of its own sequence).
        shift: log2 of the tokens per page.
        page, width, offset: per array of `ARRAYS`, in elements of its dtype: a page's size, a slot's, and where
            its region starts in a page.
    """

    slots: torch.Tensor
    shift: int
    page: tuple[int, ...]
    width: tuple[int, ...]
    offset: tuple[int, ...]

    def elements(self, array: int, slots: torch.Tensor) -> torch.Tensor:
        """The first element of each slot's data in array `array` (an index into `ARRAYS`), int64."""
        s = slots.long()
        return ((s >> self.shift) * self.page[array] + (s & ((1 << self.shift) - 1)) * self.width[array]
                + self.offset[array])

    def starts(self, array: int, tokens: int) -> torch.Tensor:
        """`elements` of the first `tokens` tokens of every row, in slot order n = t * B + b: int64 [T * B]."""
        return self.elements(array, self.slots[:, :tokens].t().reshape(-1))


class StoreView(NamedTuple):
    """One layer's compressed cache as the kernels read it; see the module docstring.

    Attributes:
        heads, head_dim: KV heads H and their width D; C = H * D channels per token.
        k_bits, v_bits: code widths.
        tokens: T, the rows in use of every token-major array; B rows each.
        k_codes, v_codes: int32 [>= T, B, W]: each slot's C codes packed along channels (`kvsqueeze.numerics.packing`).
        k_scale, k_zero: fp16 [C], offline per-channel key scale and zero-point.
        k_levels, v_levels: float32 [2**bits], the layer's codebooks; element = scale * level + zero. With a
            width per channel, [C, 2**bits]: row c is channel c's codebook (its 2**w_c levels, repeated).
        v_scale_zero: fp16 [>= T, B, 2], per-slot value scale and zero-point.
        k_outliers, v_outliers: `Outliers` or None.
        sink_k, sink_v: fp16 [B, S, C], exact pre-RoPE keys and values of each row's sinks.
        sink_slot: int32 [B, S], the token index t of each sink (-1: none); its slot's codes are ignored.
        positions: int32 [>= T, B], the RoPE position of every cached token.
        memo: a dict that lives as long as these allocations: a backend keeps there what it derives from
            them (numpy views, lookup tables), checking that they are still the arrays it was built from.
        k_offsets, v_offsets: int32 [C + 1] where channels have widths of their own (`nuq@AVG:chan`): channel c's
            code is bits [off[c], off[c + 1]) of its slot's stream (`packing.pack_mixed`); None: `k_bits` /
            `v_bits` for every channel.
        rows: `Rows` where the arrays are flat views of paged storage (k_codes, v_codes int32; v_scale_zero fp16;
            outliers of a fixed count, `pointers` None, channels int16 and values fp16), read through `Rows`;
            None: token-major arrays.
    """

    heads: int
    head_dim: int
    k_bits: int
    v_bits: int
    tokens: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    k_levels: torch.Tensor
    v_levels: torch.Tensor
    v_scale_zero: torch.Tensor
    k_outliers: Outliers | None
    v_outliers: Outliers | None
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_slot: torch.Tensor
    positions: torch.Tensor
    memo: dict | None = None
    k_offsets: torch.Tensor | None = None
    v_offsets: torch.Tensor | None = None
    rows: Rows | None = None

    @property
    def batch(self) -> int:
        return self.k_codes.shape[1] if self.rows is None else self.rows.slots.shape[0]

    def gathered(self) -> StoreView:
        """This view with token-major arrays: itself when it has them, else its slots copied into slot order."""
        if self.rows is None:
            return self
        t, b, rows = self.tokens, self.batch, self.rows

        def take(x: torch.Tensor, array: int) -> torch.Tensor:  # [T * B, width], slot n = t * B + b
            w = rows.width[array]
            idx = rows.starts(array, t).view(-1, 1) + torch.arange(w, device=x.device)
            return x[idx]

        def outliers(o: Outliers | None, ch: int, val: int) -> Outliers | None:
            if o is None:
                return None
            return o._replace(pointers=None, channels=take(o.channels, ch).reshape(-1),
                              values=take(o.values, val).reshape(-1), nnz=t * b * o.fixed)

        return self._replace(k_codes=take(self.k_codes, 0).view(t, b, -1), v_codes=take(self.v_codes, 1).view(t, b, -1),
                             v_scale_zero=take(self.v_scale_zero, 2).view(t, b, 2),
                             k_outliers=outliers(self.k_outliers, 3, 4), v_outliers=outliers(self.v_outliers, 5, 6),
                             rows=None, memo={})

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    def trim(self) -> StoreView:
        """The same view with every array cut to the rows in use (a new memo: the arrays are other tensors);
        token-major (`gathered`)."""
        if self.rows is not None:
            return self.gathered().trim()
        t, slots = self.tokens, self.tokens * self.batch
        return self._replace(
            k_codes=self.k_codes[:t], v_codes=self.v_codes[:t], v_scale_zero=self.v_scale_zero[:t],
            k_outliers=self.k_outliers and self.k_outliers.trim(slots),
            v_outliers=self.v_outliers and self.v_outliers.trim(slots),
            positions=self.positions[:t], memo={})
