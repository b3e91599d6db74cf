"""Optimal weighted one-dimensional k-means for non-uniform KV-cache codebooks.

KVQuant (Hooper et al., "KVQuant: Towards 10 Million Context Length LLM
Inference with KV Cache Quantization", NeurIPS 2024, arXiv:2401.18079) builds
one non-uniform ("nuqX") codebook of `2**bits` levels per layer by running a
*sensitivity-weighted* k-means on normalized activations: each value `x` in
`[-1, 1]` carries a weight `w` (Fisher information times the squared
per-channel / per-token scale), and the codebook minimises

    sum_i  w_i * (x_i - c(x_i))**2,        c(x) = the centre nearest to x.

Why an exact dynamic programme works
------------------------------------
In one dimension every optimal clustering is *contiguous*: if `a < b < c` and
`a` and `c` shared a centre while `b` used a different one, moving `b`
to the centre nearer to it would not increase the cost, so after sorting the
data, an optimal k-clustering is a split of the sorted sequence into `k`
consecutive runs, each served by its weighted mean.  With prefix sums
`S0 = sum w`, `S1 = sum w x`, `S2 = sum w x**2` the cost of a run is
`S2 - S1**2 / S0` in O(1), and

    D[c][j] = min_{i < j}  D[c-1][i] + cost(i, j)

gives the global optimum -- no random restarts, no local minima, unlike
Lloyd's algorithm (which KVQuant uses through scikit-learn).  The cost is a
Monge array (it satisfies the quadrangle inequality), so the optimal split
point `opt[c][j]` is non-decreasing in `j`; a divide-and-conquer sweep per
layer of the table therefore needs O(B log B) cost evaluations, O(k B log B)
in total, where `B` is the number of atoms.

Millions of activations per layer are reduced first to a
`WeightedHistogram` over a fixed bin grid holding per-bin sums of
`w`, `w x` and `w x**2`.  Each non-empty bin becomes one atom placed at
its weighted mean.  Because `sum_{i in bin} w_i (x_i - c)**2` equals the
bin's own spread plus `W_bin * (mean_bin - c)**2`, the binned problem is
exact *given* that a bin is never split between two centres; the only
approximation is that restriction, whose effect vanishes as the grid is
refined.  The reported objective includes the within-bin spread and is
therefore the true weighted SSE of the raw data under that assignment.

Public API: `WeightedHistogram`, `fit_codebook`,
`weighted_kmeans_1d`, `kmeans_objective`, `KMeansResult`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ..numba_cache import install

install()  # cache entries follow every file of this directory

__all__ = [
    "KMeansResult",
    "WeightedHistogram",
    "fit_codebook",
    "kmeans_objective",
    "weighted_kmeans_1d",
]


# --------------------------------------------------------------------------
# result type
# --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class KMeansResult:
    """Outcome of a 1-D weighted k-means fit.

    Attributes:
        centers: `float64` array of exactly `k` centres, sorted ascending.  When the
            data have fewer distinct atoms `m` than `k`, every atom is its own
            centre and the `k - m` spare centres are filled in (see
            `fit_codebook` / `weighted_kmeans_1d`); spares may then
            coincide with nothing in the data.
        objective: weighted sum of squared errors `sum_i w_i (x_i - c(x_i))**2`.
        boundaries: `int64` array, ascending, of the first index of each *non-empty*
            cluster: a bin index for `fit_codebook`, an index into the
            sorted distinct positive-weight values for
            `weighted_kmeans_1d`.  Its length is `min(k, m)`; when
            `m >= k`, `boundaries[j]` is where the cluster of `centers[j]`
            starts and it ends where the next one starts.
    """

    centers: np.ndarray
    objective: float
    boundaries: np.ndarray


# --------------------------------------------------------------------------
# input helpers
# --------------------------------------------------------------------------
def _to_numpy_f64(a, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().to(device="cpu", dtype=torch.float64).numpy()
    try:
        return np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numeric (array or tensor): {exc}") from exc


def _prepare_xw(x, w) -> tuple[np.ndarray, np.ndarray]:
    """Validate `x`/`w` (any shape, equal shapes) and return flat float64 copies."""
    xa = _to_numpy_f64(x, "x")
    wa = np.ones_like(xa) if w is None else _to_numpy_f64(w, "w")
    if xa.shape != wa.shape:
        raise ValueError(f"x and w must have the same shape, got {xa.shape} and {wa.shape}")
    xa = xa.reshape(-1)
    wa = wa.reshape(-1)
    if not np.isfinite(xa).all():
        raise ValueError("x contains NaN or Inf")
    if not np.isfinite(wa).all():
        raise ValueError("w contains NaN or Inf")
    if (wa < 0).any():
        raise ValueError(f"weights must be non-negative, found minimum {wa.min()!r}")
    return xa, wa


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return k


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# --------------------------------------------------------------------------
# histogram accumulator
# --------------------------------------------------------------------------
class WeightedHistogram:
    """Per-bin weighted moments over a uniform grid of `bins` bins on `[lo, hi]`.

    Bin `b` covers `[lo + b*width, lo + (b+1)*width)` (the last bin also
    holds `hi`), `width = (hi - lo) / bins`.  `add` accumulates
    `w`, `w*x`, `w*x**2` (float64) and the element count per bin.

    Values outside `[lo, hi]` are **clipped to the nearest end of the range
    before accumulation**: they land in the first / last bin *and* contribute
    `lo` / `hi` (not their raw value) to `wx` and `wx2`, so every bin
    mean -- and hence every fitted centre -- stays inside `[lo, hi]`.  The
    number of clipped elements is kept in `clipped`.
    """

    def __init__(self, bins: int = 4096, lo: float = -1.0, hi: float = 1.0):
        if isinstance(bins, bool) or not isinstance(bins, numbers.Integral) or bins < 1:
            raise ValueError(f"bins must be a positive integer, got {bins!r}")
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
        self.bins = int(bins)
        self.lo = lo
        self.hi = hi
        self.w = np.zeros(self.bins, dtype=np.float64)
        self.wx = np.zeros(self.bins, dtype=np.float64)
        self.wx2 = np.zeros(self.bins, dtype=np.float64)
        self.count = np.zeros(self.bins, dtype=np.int64)
        self.clipped = 0

    # -- geometry ----------------------------------------------------------
    @property
    def width(self) -> float:
        return (self.hi - self.lo) / self.bins

    def bin_edges(self) -> np.ndarray:
        """The `bins + 1` bin edges."""
        return np.linspace(self.lo, self.hi, self.bins + 1)

    def bin_centers(self) -> np.ndarray:
        """Mid-point of every bin."""
        return self.lo + (np.arange(self.bins, dtype=np.float64) + 0.5) * self.width

    @property
    def total_weight(self) -> float:
        return float(self.w.sum())

    @property
    def total_count(self) -> int:
        return int(self.count.sum())

    def __repr__(self) -> str:
        return (
            f"WeightedHistogram(bins={self.bins}, lo={self.lo}, hi={self.hi}, "
            f"count={self.total_count}, weight={self.total_weight:.6g})"
        )

    # -- accumulation ------------------------------------------------------
    def add(self, x, w=None) -> "WeightedHistogram":
        """Accumulate `x` with weights `w` (same shape, any shape; `None` = unit).

        Accepts numpy arrays or torch tensors.  A torch `x` is binned on its
        own device (float64 `torch.bincount`) and only the `bins`-long
        sums come back to the host.  Raises `ValueError` on mismatched
        shapes, NaN/Inf in `x` or `w`, or negative weights.  Returns
        `self` so calls can be chained.
        """
        if isinstance(x, torch.Tensor) or isinstance(w, torch.Tensor):
            sums = self._sums_torch(x, w)
        else:
            sums = self._sums_numpy(x, w)
        if sums is None:
            return self
        sw, swx, swx2, cnt, nclip = sums
        self.w += sw
        self.wx += swx
        self.wx2 += swx2
        self.count += cnt
        self.clipped += nclip
        return self

    def merge(self, other: "WeightedHistogram") -> "WeightedHistogram":
        """Add another histogram on the identical grid into this one."""
        if (other.bins, other.lo, other.hi) != (self.bins, self.lo, self.hi):
            raise ValueError(
                "cannot merge histograms on different grids: "
                f"{(self.bins, self.lo, self.hi)} vs {(other.bins, other.lo, other.hi)}"
            )
        self.w += other.w
        self.wx += other.wx
        self.wx2 += other.wx2
        self.count += other.count
        self.clipped += other.clipped
        return self

    def _sums_numpy(self, x, w):
        xa, wa = _prepare_xw(x, w)
        if xa.size == 0:
            return None
        nclip = int(np.count_nonzero((xa < self.lo) | (xa > self.hi)))
        xc = np.clip(xa, self.lo, self.hi)
        idx = np.floor((xc - self.lo) * (self.bins / (self.hi - self.lo))).astype(np.int64)
        np.clip(idx, 0, self.bins - 1, out=idx)
        wx = wa * xc
        return (
            np.bincount(idx, weights=wa, minlength=self.bins),
            np.bincount(idx, weights=wx, minlength=self.bins),
            np.bincount(idx, weights=wx * xc, minlength=self.bins),
            np.bincount(idx, minlength=self.bins).astype(np.int64),
            nclip,
        )

    def _sums_torch(self, x, w):
        xt = x.detach() if isinstance(x, torch.Tensor) else None
        wt = w.detach() if isinstance(w, torch.Tensor) else None
        device = xt.device if xt is not None else wt.device
        if device.type != "cpu" and torch.are_deterministic_algorithms_enabled():
            device = torch.device("cpu")  # weighted bincount is non-deterministic on CUDA
        xt = torch.as_tensor(x if xt is None else xt, device=device).to(torch.float64)
        if w is None:
            wt = torch.ones_like(xt)
        else:
            wt = torch.as_tensor(w if wt is None else wt, device=device).to(torch.float64)
        if xt.shape != wt.shape:
            raise ValueError(
                f"x and w must have the same shape, got {tuple(xt.shape)} and {tuple(wt.shape)}"
            )
        xt = xt.reshape(-1)
        wt = wt.reshape(-1)
        if xt.numel() == 0:
            return None
        if not bool(torch.isfinite(xt).all()):
            raise ValueError("x contains NaN or Inf")
        if not bool(torch.isfinite(wt).all()):
            raise ValueError("w contains NaN or Inf")
        if bool((wt < 0).any()):
            raise ValueError(f"weights must be non-negative, found minimum {float(wt.min())!r}")
        nclip = int(((xt < self.lo) | (xt > self.hi)).sum())
        xc = xt.clamp(self.lo, self.hi)
        idx = torch.floor((xc - self.lo) * (self.bins / (self.hi - self.lo))).long()
        idx.clamp_(0, self.bins - 1)
        wx = wt * xc

        def bc(weights=None):
            return torch.bincount(idx, weights=weights, minlength=self.bins).cpu().numpy()

        return (
            bc(wt).astype(np.float64),
            bc(wx).astype(np.float64),
            bc(wx * xc).astype(np.float64),
            bc().astype(np.int64),
            nclip,
        )


# --------------------------------------------------------------------------
# the exact DP (numba)
# --------------------------------------------------------------------------
@numba.njit(cache=True)
def _run_cost(p0, p1, p2, i, j):
    s0 = p0[j] - p0[i]
    if s0 <= 0.0:  # atoms far lighter than the running total vanish in the prefix sum: they cost nothing
        return 0.0
    s1 = p1[j] - p1[i]
    v = (p2[j] - p2[i]) - s1 * s1 / s0
    return v if v > 0.0 else 0.0


@numba.njit(cache=True)
def _dp_starts(pos, wt, k):
    """Start indices (length k) of the optimal k contiguous runs of atoms.

    `pos` sorted ascending, `wt` > 0, `2 <= k <= len(pos)`.  Row `c` of
    the table is filled by divide and conquer using monotone split points.
    """
    m = pos.shape[0]
    # translate to the weighted mean to limit cancellation in S2 - S1^2/S0
    tot = 0.0
    mu = 0.0
    for a in range(m):
        tot += wt[a]
        mu += wt[a] * pos[a]
    mu /= tot
    p0 = np.zeros(m + 1)
    p1 = np.zeros(m + 1)
    p2 = np.zeros(m + 1)
    for a in range(m):
        d = pos[a] - mu
        p0[a + 1] = p0[a] + wt[a]
        p1[a + 1] = p1[a] + wt[a] * d
        p2[a + 1] = p2[a] + wt[a] * d * d

    inf = np.inf
    prev = np.full(m + 1, inf)
    cur = np.full(m + 1, inf)
    for j in range(1, m + 1):
        prev[j] = _run_cost(p0, p1, p2, 0, j)
    arg = np.zeros((k, m + 1), dtype=np.int32)

    # explicit stack of (jlo, jhi, ilo, ihi); depth <= log2(m) + 2
    stack = np.empty((256, 4), dtype=np.int64)
    for c in range(2, k + 1):
        for t in range(m + 1):
            cur[t] = inf
        jmax = m - (k - c)  # leave at least one atom for every later cluster
        stack[0, 0] = c
        stack[0, 1] = jmax
        stack[0, 2] = c - 1
        stack[0, 3] = jmax - 1
        top = 1
        while top > 0:
            top -= 1
            jlo = stack[top, 0]
            jhi = stack[top, 1]
            ilo = stack[top, 2]
            ihi = stack[top, 3]
            if jlo > jhi:
                continue
            mid = (jlo + jhi) // 2
            iend = ihi if ihi < mid - 1 else mid - 1
            best = inf
            bi = ilo
            for i in range(ilo, iend + 1):
                v = prev[i] + _run_cost(p0, p1, p2, i, mid)
                if v < best:
                    best = v
                    bi = i
            cur[mid] = best
            arg[c - 1, mid] = bi
            stack[top, 0] = jlo
            stack[top, 1] = mid - 1
            stack[top, 2] = ilo
            stack[top, 3] = bi
            top += 1
            stack[top, 0] = mid + 1
            stack[top, 1] = jhi
            stack[top, 2] = bi
            stack[top, 3] = ihi
            top += 1
        tmp = prev
        prev = cur
        cur = tmp

    starts = np.zeros(k, dtype=np.int64)
    j = m
    for c in range(k, 1, -1):
        j = arg[c - 1, j]
        starts[c - 1] = j
    starts[0] = 0
    return starts


def _optimal_runs(pos: np.ndarray, wt: np.ndarray, k: int) -> np.ndarray:
    """Start indices of the optimal `min(k, m)` runs of the sorted atoms."""
    m = pos.shape[0]
    if k >= m:
        return np.arange(m, dtype=np.int64)
    if k == 1:
        return np.zeros(1, dtype=np.int64)
    return _dp_starts(np.ascontiguousarray(pos), np.ascontiguousarray(wt), k)


def _fill_centers(centers: np.ndarray, k: int, lo: float | None, hi: float | None) -> np.ndarray:
    """Pad sorted `centers` to `k` entries by bisecting the widest gap.

    The gaps considered are those between consecutive centres and, when
    `lo`/`hi` are given, between `lo` and the first centre and between
    the last centre and `hi`.  Each spare centre goes to the midpoint of
    the currently widest gap (leftmost on ties).  With no gap at all (a
    single centre and no range) the centre is duplicated.
    """
    pts = [float(c) for c in centers]
    extra = k - len(pts)
    if extra <= 0:
        return np.asarray(pts, dtype=np.float64)
    fence = ([lo] if lo is not None else []) + pts + ([hi] if hi is not None else [])
    is_center = ([False] if lo is not None else []) + [True] * len(pts) + (
        [False] if hi is not None else []
    )
    for _ in range(extra):
        gaps = np.diff(np.asarray(fence)) if len(fence) > 1 else np.zeros(0)
        if gaps.size == 0 or gaps.max() <= 0.0:
            # nothing to bisect: duplicate the last real centre
            g = max(i for i, c in enumerate(is_center) if c)
            fence.insert(g + 1, fence[g])
            is_center.insert(g + 1, True)
            continue
        g = int(np.argmax(gaps))
        fence.insert(g + 1, 0.5 * (fence[g] + fence[g + 1]))
        is_center.insert(g + 1, True)
    out = np.asarray([f for f, c in zip(fence, is_center) if c], dtype=np.float64)
    return np.sort(out)


# --------------------------------------------------------------------------
# public solvers
# --------------------------------------------------------------------------
def fit_codebook(hist: WeightedHistogram, k: int) -> KMeansResult:
    """Optimal weighted k-means on the atoms of `hist` (one atom per non-empty bin).

    Each bin with positive weight is an atom of weight `w[b]` at
    `wx[b] / w[b]`; zero-weight bins are dropped.  Clusters are contiguous
    runs of bins (a bin is never split).  `objective` is the exact weighted
    SSE of the accumulated raw data under that assignment, within-bin spread
    included.

    If fewer than `k` bins carry weight, every such bin gets its own centre
    and the rest are filled deterministically: each spare centre is placed
    at the midpoint of the widest gap among `lo`, the centres so far, and
    `hi` (leftmost gap on ties), so the codebook still covers `[lo, hi]`
    and the objective is unaffected.

    Raises `ValueError` for `k < 1` or when the histogram's total weight
    is zero.
    """
    k = _check_k(k)
    if not isinstance(hist, WeightedHistogram):
        raise ValueError(f"hist must be a WeightedHistogram, got {type(hist).__name__}")
    nz = np.flatnonzero(hist.w > 0)
    if nz.size == 0:
        raise ValueError(
            "histogram has zero total weight (no data added, or all weights were 0); "
            "cannot fit a codebook"
        )
    W = hist.w[nz]
    S1 = hist.wx[nz]
    S2 = hist.wx2[nz]
    pos = np.clip(S1 / W, hist.lo, hist.hi)
    within = float(np.maximum(S2 - S1 * S1 / W, 0.0).sum())

    starts = _optimal_runs(pos, W, k)
    csum_w = np.add.reduceat(W, starts)
    centers = np.clip(np.add.reduceat(W * pos, starts) / csum_w, hist.lo, hist.hi)
    lengths = np.diff(np.append(starts, pos.size))
    between = float(np.sum(W * (pos - np.repeat(centers, lengths)) ** 2))

    full = _fill_centers(centers, k, hist.lo, hist.hi)
    return KMeansResult(
        centers=_readonly(full),
        objective=within + between,
        boundaries=_readonly(nz[starts].astype(np.int64)),
    )


def weighted_kmeans_1d(x, w, k: int) -> KMeansResult:
    """Exact weighted k-means on raw 1-D data (no binning).

    `x` and `w` are arrays or tensors of equal shape (flattened);
    `w=None` means unit weights.  Equal values are merged (weights summed)
    and zero-weight values dropped, then the same DP runs over the sorted
    distinct values.  `boundaries` index that sorted distinct array.

    If there are `m < k` distinct values, each is its own centre
    (objective 0) and each spare centre goes to the midpoint of the widest
    gap between the centres so far (leftmost on ties); with a single
    distinct value it is repeated `k` times.

    Raises `ValueError` for `k < 1`, mismatched shapes, NaN/Inf,
    negative weights, or zero total weight.
    """
    k = _check_k(k)
    xa, wa = _prepare_xw(x, w)
    keep = wa > 0
    if not keep.any():
        raise ValueError("total weight is zero (empty input or all weights 0); nothing to fit")
    xa = xa[keep]
    wa = wa[keep]
    pos, inv = np.unique(xa, return_inverse=True)
    W = np.bincount(inv.reshape(-1), weights=wa, minlength=pos.size)

    starts = _optimal_runs(pos, W, k)
    centers = np.add.reduceat(W * pos, starts) / np.add.reduceat(W, starts)
    centers = np.clip(centers, pos[0], pos[-1])
    lengths = np.diff(np.append(starts, pos.size))
    objective = float(np.sum(W * (pos - np.repeat(centers, lengths)) ** 2))

    full = _fill_centers(centers, k, None, None)
    return KMeansResult(
        centers=_readonly(full),
        objective=objective,
        boundaries=_readonly(starts.astype(np.int64)),
    )


def kmeans_objective(x, w, centers) -> float:
    """Weighted SSE `sum_i w_i (x_i - c(x_i))**2` with `c(x)` the nearest centre.

    `w=None` means unit weights.  Raises `ValueError` on bad inputs or an
    empty / non-finite `centers`.
    """
    xa, wa = _prepare_xw(x, w)
    c = np.sort(_to_numpy_f64(centers, "centers").reshape(-1))
    if c.size == 0:
        raise ValueError("centers must not be empty")
    if not np.isfinite(c).all():
        raise ValueError("centers contain NaN or Inf")
    if xa.size == 0:
        return 0.0
    hi_idx = np.clip(np.searchsorted(c, xa), 0, c.size - 1)
    lo_idx = np.clip(hi_idx - 1, 0, c.size - 1)
    d = np.minimum((xa - c[lo_idx]) ** 2, (xa - c[hi_idx]) ** 2)
    return float(np.sum(wa * d))
