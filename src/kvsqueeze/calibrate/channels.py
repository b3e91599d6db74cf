"""Per-channel weighted histograms of normalized activations, and each channel's error at a codebook.

A layer's codebook is fitted to one histogram of all its channels (`kmeans.WeightedHistogram`), and a
per-channel bit budget (`methods.budget.allocate_channels`) needs every channel's weighted error at every
candidate codebook. Both come from one pass here: the elements are binned once, per channel, into a
[C, bins] grid of sums of w, w x and w x^2 (one numba pass); the layer's histogram is the sum over channels,
and a channel's error at a codebook is, bin by bin, the bin's spread plus its weight times its mean's squared
distance to the nearest level: sum w (x - c)^2 = S2 - 2 c S1 + c^2 S0. Each bin is assigned whole, as in the
k-means fit itself; with 4,096 bins over [-1, 1] a bin is under a tenth of the spacing of 6-bit levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from .kmeans import WeightedHistogram


@dataclass(frozen=True)
class ChannelHistograms:
    """Per-channel sums over a uniform grid of `bins` bins on [-1, 1]: w, w x, w x^2 (float64) and counts."""

    w: np.ndarray  # [C, bins]
    wx: np.ndarray  # [C, bins]
    wx2: np.ndarray  # [C, bins]
    count: np.ndarray  # [C, bins] int64

    def whole(self) -> WeightedHistogram:
        """The histogram of every channel together, on the same grid."""
        hist = WeightedHistogram(bins=self.w.shape[1])
        hist.w += self.w.sum(0)
        hist.wx += self.wx.sum(0)
        hist.wx2 += self.wx2.sum(0)
        hist.count += self.count.sum(0)
        return hist

    def errors(self, codebooks: list[torch.Tensor]) -> torch.Tensor:
        """[C, len(codebooks)] float64: each channel's sum of w (x - c(x))^2 at each codebook's levels."""
        return torch.from_numpy(np.stack([level_errors(self.w, self.wx, self.wx2, levels.double().numpy())
                                          for levels in codebooks], axis=1))


def level_errors(w: np.ndarray, wx: np.ndarray, wx2: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Sum of w (x - c(x))^2 of each histogram (rows of per-bin sums [H, bins], float64) at `levels`, every bin
    assigned whole to the level nearest its mean: [H]."""
    lv = np.sort(np.asarray(levels, dtype=np.float64))
    out = np.empty(w.shape[0])
    _errors(w, wx, wx2, lv, (lv[1:] + lv[:-1]) / 2, out)
    return out


def channel_histograms(x: torch.Tensor, w: torch.Tensor, inside: torch.Tensor, bins: int) -> ChannelHistograms:
    """Bin normalized activations per channel.

    Args:
        x: [N, C] float, normalized to [-1, 1] (values beyond are clipped to its ends, as `WeightedHistogram`
            does).
        w: [N, C] non-negative finite weights.
        inside: [N, C] bool; elements outside (outliers, stored exactly) are left out.
    """
    c = x.shape[1]
    sums = np.zeros((c, bins, 3))  # a bin's three sums side by side: one cache line
    count = np.zeros((c, bins), dtype=np.int64)
    # channel-major, so that one channel's grid stays in cache while its tokens are read
    _bin(x.float().t().contiguous().numpy(), w.float().t().contiguous().numpy(), inside.t().contiguous().numpy(),
         sums, count)
    return ChannelHistograms(w=sums[..., 0], wx=sums[..., 1], wx2=sums[..., 2], count=count)


@numba.njit(cache=True)
def _bin(x, w, inside, sums, count):
    # x, w, inside [C, N]; the same grid and clipping as WeightedHistogram, in float64
    c, n = x.shape
    bins = count.shape[1]
    half = bins / 2.0
    for j in range(c):
        for i in range(n):
            if not inside[j, i]:
                continue
            v = min(max(np.float64(x[j, i]), -1.0), 1.0)
            b = min(max(int(np.floor((v + 1.0) * half)), 0), bins - 1)
            wt = np.float64(w[j, i])
            sums[j, b, 0] += wt
            sums[j, b, 1] += wt * v
            sums[j, b, 2] += wt * v * v
            count[j, b] += 1


@numba.njit(cache=True)
def _errors(w, wx, wx2, levels, mids, out):
    # bins run in ascending order and so do their means: the nearest level only moves up along a channel
    c, bins = w.shape
    for j in range(c):
        p = 0
        total = 0.0
        for b in range(bins):
            if w[j, b] <= 0.0:
                continue
            m = wx[j, b] / w[j, b]
            while p < len(mids) and m > mids[p]:
                p += 1
            lv = levels[p]
            total += wx2[j, b] - 2.0 * lv * wx[j, b] + lv * lv * w[j, b]
        out[j] = max(total, 0.0)  # rounding can leave a tiny negative for an exact fit
