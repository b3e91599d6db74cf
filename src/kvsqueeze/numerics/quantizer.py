"""Per-layer key and value quantizers built from a method and a recipe (pure torch).

A `VectorQuantizer` quantizes a [N, C] matrix of N tokens by C channels
(C = kv_heads * head_dim): along the channel axis one (scale, zero) per channel
comes from offline calibration; along the token axis one per token (or per
group of channels) is computed online. Outliers outside the per-vector or
per-matrix thresholds are kept exactly in fp16. A method's family builds them
from a `Recipe` (`methods.build_quantizers`, the registry); the simulated evaluation and the
compressed cache both use them. The
arithmetic itself (scale, zero-point, nearest level) is `affine.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .affine import choose_qparams, dequantize, quantize
from .datatypes import check_codebook
from .outliers import clamp_range, fixed_outlier_count, online_thresholds, outlier_mask, topk_per_side
from .packing import code_offsets


@dataclass(frozen=True)
class Encoded:
    """One quantized [N, C] block: codes plus what it takes to decode them."""

    codes: torch.Tensor  # uint8 [N, C]
    scale: torch.Tensor  # float32, broadcastable to [N, C]
    zero: torch.Tensor
    outliers: torch.Tensor | None  # bool [N, C]: elements stored exactly


@dataclass(frozen=True, eq=False)
class VectorQuantizer:
    """Quantizer for [N tokens, C channels] matrices; see the module docstring."""

    levels: torch.Tensor  # float32 [2**bits], sorted, in [-1, 1]
    axis: str  # "channel" (offline per-channel range) or "token" (online per-token range)
    fraction: float = 0.0  # outliers kept exactly
    scope: str = "vector"  # "vector" or "matrix" thresholds
    lo: torch.Tensor | None = None  # channel axis: per-channel clipping range [C]
    hi: torch.Tensor | None = None
    mat_lo: float | None = None  # token axis, per-matrix outliers: thresholds
    mat_hi: float | None = None
    group: int = 0  # token axis: channels per (scale, zero) group; 0 = the whole token
    slots: int = 0  # channel axis: exact elements per token, a fixed count (0: every element past the range)
    widths: torch.Tensor | None = None  # int [C]: each channel's own code width (':chan' budgets); None: `bits`
    codebooks: dict[int, torch.Tensor] | None = None  # with `widths`: the levels of every width they use

    @property
    def bits(self) -> int:
        """The code width of every channel (with `widths`, the widest; `levels` are its codebook)."""
        return int(self.levels.numel()).bit_length() - 1

    @functools.cached_property
    def decode_levels(self) -> torch.Tensor:
        """The levels decoding reads: `levels`, or with `widths` float32 [C, 2**bits] whose row c is channel c's
        codebook repeated to the widest one's size, so that a code read with bits to spare above it still selects
        its own level."""
        if self.widths is None:
            return self.levels
        n = self.levels.numel()
        return torch.stack([self.codebooks[int(w)].repeat(n >> int(w)) for w in self.widths])

    def to(self, device: torch.device | str) -> VectorQuantizer:
        """The same quantizer with its tensors on `device`."""
        moved = {k: getattr(self, k).to(device) for k in ("levels", "lo", "hi", "widths")
                 if getattr(self, k) is not None}
        if self.codebooks is not None:
            moved["codebooks"] = {w: cb.to(device) for w, cb in self.codebooks.items()}
        return dataclasses.replace(self, **moved)

    def _codes(self, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        if self.widths is None:
            return quantize(x, scale, zero, self.levels)
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        for w, sel in self._groups:
            codes[:, sel] = quantize(x[:, sel], _cols(scale, sel), _cols(zero, sel), self.codebooks[w])
        return codes

    def _values(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize(codes, scale, zero, self.decode_levels)

    @functools.cached_property
    def _groups(self) -> list[tuple[int, torch.Tensor]]:
        """(width, its channels) of every width in use; found once per quantizer (no host sync per token)."""
        return [(int(w), (self.widths == w).nonzero().view(-1)) for w in torch.unique(self.widths)]

    def stream_offsets(self, channels: int) -> torch.Tensor:
        """Stream bit offsets int64 [C + 1] of one vector's codes: c * bits for one width, the running sum of the
        channels' own widths otherwise (`packing.code_offsets`), on the CPU (what the numba kernels read)."""
        if self.widths is None:
            return torch.arange(channels + 1, dtype=torch.int64) * self.bits
        return code_offsets(self.widths.cpu()).to(torch.int64)

    def widths_problem(self, channels: int) -> str | None:
        """What is wrong with this quantizer's channel widths for vectors of `channels` channels (a width per
        channel, each with its codebook), or None: the one check the HF store and the page layout share."""
        if self.widths is None:
            return None
        if self.widths.numel() != channels or not set(self.widths.tolist()) <= set(self.codebooks or ()):
            return f"{self.widths.numel()} channel widths for {channels} channels, or a width without its codebook"
        return None

    def channel_midpoints(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each channel's codebook midpoints float32 [C, M] (+inf past a channel's own, computed as
        `affine.quantize` computes its boundaries) and their count int64 [C], on the CPU: the nearest level of a
        normalized element is the count of midpoints below it (the numba encoders)."""
        books = [self.levels.float().cpu()] * channels if self.widths is None else \
            [self.codebooks[int(w)].float().cpu() for w in self.widths.tolist()]
        count = torch.tensor([lv.numel() - 1 for lv in books], dtype=torch.int64)
        mids = torch.full((channels, max(1, int(count.max()))), float("inf"))
        for ch, lv in enumerate(books):
            mids[ch, : lv.numel() - 1] = (lv[1:] + lv[:-1]) * 0.5
        return mids, count

    def outliers_per_side(self, channels: int) -> int:
        """Per-token top-k: outliers kept above (and below) each token's range."""
        return topk_per_side(self.fraction, channels)

    def fixed_outliers(self, channels: int) -> int | None:
        """Outliers every token keeps under per-token top-k thresholds (None when the count varies)."""
        if not fixed_outlier_count(self.axis, self.scope, self.fraction):
            return None
        return 2 * self.outliers_per_side(channels)

    def ranges(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clipping range [lo, hi] for x [N, C] (shapes [1, C] or [N, 1])."""
        if self.axis == "channel":
            return self.lo.view(1, -1), self.hi.view(1, -1)
        if self.fraction > 0 and self.scope == "matrix":
            return clamp_range(x, torch.tensor(self.mat_lo), torch.tensor(self.mat_hi), dim=1)
        return online_thresholds(x, self.fraction, dim=1)

    def encode(self, x: torch.Tensor) -> Encoded:
        """Quantize x [N, C] (float) into codes, scales, zero-points and an outlier mask."""
        if self.group:
            return self._encode_grouped(x)
        if self.axis == "token" and self.scope == "vector" and self.fraction > 0:
            lo, hi, mask = self._top_k(x)
        else:
            lo, hi = self.ranges(x)
            mask = outlier_mask(x, lo, hi) if self.fraction > 0 else None
        scale, zero = choose_qparams(lo, hi)
        codes = self._codes(x, scale, zero)
        if self.slots and mask is not None:
            mask = self._slots(x, codes, scale, zero, mask)
        return Encoded(codes, scale, zero, mask)

    def _slots(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               past: torch.Tensor) -> torch.Tensor:
        """Exactly `slots` exact elements per token: its outliers first (the farthest past the range when it has
        more; the rest clip), then the in-range elements its codes round worst."""
        err = (self._values(codes, scale, zero) - x).abs()  # an outlier's: its distance past the range
        err = torch.where(past, err + err.amax(dim=1, keepdim=True) + 1, err)
        chosen = err.topk(min(self.slots, x.shape[1]), dim=1).indices
        return torch.zeros_like(past).scatter_(1, chosen, True)

    def _top_k(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Exactly k outliers above and k below per token (ties broken by position), and the range between."""
        k = self.outliers_per_side(x.shape[1])
        if k == 0:
            return x.amin(1, keepdim=True), x.amax(1, keepdim=True), torch.zeros_like(x, dtype=torch.bool)
        # stable sorts: among equal elements the lower channel is the outlier (what the fused encoders do)
        top = torch.sort(x, dim=1, descending=True, stable=True).indices[:, : k + 1]
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(1, top[:, :k], True)
        rest = x.masked_fill(mask, float("inf"))  # the smallest among the channels the top k left
        bottom = torch.sort(rest, dim=1, stable=True).indices[:, : k + 1]
        mask.scatter_(1, bottom[:, :k], True)
        return x.gather(1, bottom[:, k:]), x.gather(1, top[:, k:]), mask

    def _encode_grouped(self, x: torch.Tensor) -> Encoded:
        n, c = x.shape
        g = self.group
        width = -(-c // g) * g
        # pad with each row's last value, which sits in the last group: no group's min or max changes
        padded = torch.cat([x, x[:, -1:].expand(n, width - c)], dim=1).view(n, -1, g)
        scale, zero = choose_qparams(padded.amin(-1, keepdim=True), padded.amax(-1, keepdim=True))
        codes = quantize(padded, scale, zero, self.levels).view(n, width)[:, :c]
        expand = lambda t: t.expand(n, width // g, g).reshape(n, width)[:, :c]  # noqa: E731
        return Encoded(codes, expand(scale), expand(zero), None)

    def decode(self, enc: Encoded, x_exact: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantize; where `enc.outliers` is set, take x_exact rounded to fp16."""
        out = self._values(enc.codes, enc.scale, enc.zero)
        if enc.outliers is not None and x_exact is not None:
            out = torch.where(enc.outliers, x_exact.half().float(), out)
        return out

    def fake(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Quantize-dequantize x [N, C]; returns (x_hat in x's dtype, number of outliers kept)."""
        xq, rows = self.fake_rows(x)
        return xq, int(rows.sum())

    def fake_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`fake`, with the outliers kept in each row: (x_hat, int64 [N])."""
        xf = x.float()
        enc = self.encode(xf)
        rows = enc.outliers.sum(-1) if enc.outliers is not None else torch.zeros(x.shape[0], dtype=torch.int64,
                                                                                 device=x.device)
        return self.decode(enc, xf).to(x.dtype), rows


def _cols(t: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """The selected channels of a per-channel [1, C] scale or zero-point; a per-token [N, 1] one as it is."""
    return t[:, sel] if t.shape[-1] > 1 else t
