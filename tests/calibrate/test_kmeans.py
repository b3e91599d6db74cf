"""Tests for kvsqueeze.calibrate.kmeans (optimal weighted 1-D k-means)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvsqueeze.calibrate.kmeans import (
    KMeansResult,
    WeightedHistogram,
    fit_codebook,
    kmeans_objective,
    weighted_kmeans_1d,
)


# --------------------------------------------------------------------------
# brute-force references
# --------------------------------------------------------------------------
def _sse(x, w):
    W = w.sum()
    c = (w * x).sum() / W
    return float((w * (x - c) ** 2).sum())


def brute_contiguous(x, w, k):
    """Min over all splits of the sorted values into k contiguous non-empty groups."""
    order = np.argsort(x, kind="stable")
    xs, ws = x[order], w[order]
    n = xs.size
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        best = min(best, sum(_sse(xs[a:b], ws[a:b]) for a, b in zip(edges[:-1], edges[1:])))
    return best


def brute_assignments(x, w, k):
    """Min over every assignment of the n points to k labels (empty groups allowed)."""
    n = x.size
    labels = np.array(list(itertools.product(range(k), repeat=n)))  # (A, n)
    onehot = labels[:, :, None] == np.arange(k)[None, None, :]  # (A, n, k)
    sw = (onehot * w[None, :, None]).sum(1)
    swx = (onehot * (w * x)[None, :, None]).sum(1)
    swx2 = (onehot * (w * x * x)[None, :, None]).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cost = np.where(sw > 0, swx2 - swx**2 / np.where(sw > 0, sw, 1.0), 0.0)
    return float(cost.sum(1).min())


def naive_dp(x_sorted, w_sorted, k):
    """O(k m^2) textbook DP, no monotonicity assumption."""
    m = x_sorted.size
    p0 = np.concatenate([[0.0], np.cumsum(w_sorted)])
    p1 = np.concatenate([[0.0], np.cumsum(w_sorted * x_sorted)])
    p2 = np.concatenate([[0.0], np.cumsum(w_sorted * x_sorted**2)])

    def cost(i, j):
        s0 = p0[j] - p0[i]
        return max(p2[j] - p2[i] - (p1[j] - p1[i]) ** 2 / s0, 0.0)

    D = np.full((k + 1, m + 1), np.inf)
    D[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, m + 1):
            D[c, j] = min(D[c - 1, i] + cost(i, j) for i in range(c - 1, j))
    return D[k, m]


def _close(a, b, rel=1e-9, abs_=1e-12):
    return abs(a - b) <= abs_ + rel * max(abs(a), abs(b))


def _random_case(rng, n):
    if rng.random() < 0.3:  # with duplicates
        x = rng.integers(-3, 4, size=n) / 4.0
    else:
        x = rng.uniform(-1.0, 1.0, size=n)
    w = rng.uniform(0.05, 3.0, size=n)
    return x, w


# --------------------------------------------------------------------------
# optimality of the exact route
# --------------------------------------------------------------------------
def test_matches_brute_force_contiguous_and_assignments():
    rng = np.random.default_rng(1234)
    checked_assign = 0
    for _ in range(150):
        n = int(rng.integers(1, 10))
        k = int(rng.integers(1, min(4, n) + 1))
        x, w = _random_case(rng, n)
        res = weighted_kmeans_1d(x, w, k)
        assert _close(res.objective, brute_contiguous(x, w, k)), (x, w, k)
        if n <= 7:
            ba = brute_assignments(x, w, k)
            assert res.objective <= ba + 1e-12 + 1e-9 * ba, (x, w, k)
            assert _close(res.objective, ba)
            checked_assign += 1
        c = res.centers
        assert c.shape == (k,) and c.dtype == np.float64
        assert np.all(np.diff(c) >= 0)
        assert c.min() >= x.min() and c.max() <= x.max()
    assert checked_assign > 50


def test_dc_dp_matches_naive_dp_on_larger_inputs():
    rng = np.random.default_rng(7)
    for m, k in [(40, 3), (60, 5), (80, 8), (33, 33), (50, 49)]:
        x = np.sort(rng.standard_normal(m)) * 0.3
        w = rng.exponential(1.0, size=m)
        res = weighted_kmeans_1d(x, w, k)
        assert _close(res.objective, naive_dp(x, w, k), rel=1e-8)
        assert res.boundaries.shape == (k,)
        assert res.boundaries[0] == 0 and np.all(np.diff(res.boundaries) > 0)


def test_reported_objective_equals_kmeans_objective_exact_route():
    rng = np.random.default_rng(3)
    for n, k in [(5, 2), (50, 4), (500, 8), (3000, 16)]:
        x = np.clip(rng.standard_normal(n) * 0.4, -1, 1)
        w = rng.uniform(0.0, 2.0, size=n)
        res = weighted_kmeans_1d(x, w, k)
        assert _close(res.objective, kmeans_objective(x, w, res.centers), rel=1e-9)


def test_unit_weights_and_torch_inputs():
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, size=200)
    r_np = weighted_kmeans_1d(x, np.ones_like(x), 4)
    r_none = weighted_kmeans_1d(x, None, 4)
    r_t = weighted_kmeans_1d(torch.tensor(x).reshape(10, 20), torch.ones(10, 20), 4)
    np.testing.assert_allclose(r_none.centers, r_np.centers)
    np.testing.assert_allclose(r_t.centers, r_np.centers)
    assert _close(r_t.objective, r_np.objective)


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------
def test_heavy_weight_attracts_a_center():
    x = np.array([0.0, 0.1, 0.2, 0.6, 1.0])
    unweighted = weighted_kmeans_1d(x, None, 2)
    np.testing.assert_allclose(unweighted.centers, [0.1, 0.8])
    heavy = weighted_kmeans_1d(x, np.array([1.0, 1.0, 1.0, 1e6, 1.0]), 2)
    assert heavy.centers[0] == pytest.approx(0.1)
    assert abs(heavy.centers[1] - 0.6) < 1e-6  # pulled from 0.8 onto the heavy point
    # a heavy point that ends up alone gets a centre exactly on it
    x = np.array([0.0, 0.45, 0.55, 1.0])
    alone = weighted_kmeans_1d(x, np.array([1.0, 1.0, 1.0, 1e6]), 2)
    np.testing.assert_allclose(alone.centers, [1.0 / 3.0, 1.0], rtol=0, atol=1e-15)
    # k = 1: the centre is exactly the weighted mean
    one = weighted_kmeans_1d(np.array([0.0, 1.0]), np.array([3.0, 1.0]), 1)
    assert one.centers[0] == pytest.approx(0.25, abs=1e-15)


def test_scaling_weights_scales_objective_only():
    rng = np.random.default_rng(11)
    x = rng.uniform(-1, 1, size=300)
    w = rng.uniform(0.1, 1, size=300)
    a = weighted_kmeans_1d(x, w, 5)
    b = weighted_kmeans_1d(x, 1000.0 * w, 5)
    np.testing.assert_allclose(a.centers, b.centers, rtol=1e-12, atol=1e-12)
    assert _close(b.objective, 1000.0 * a.objective, rel=1e-9)


def test_zero_weight_points_are_ignored():
    x = np.array([-0.9, -0.1, 0.0, 0.1, 0.9])
    w = np.array([0.0, 1.0, 1.0, 1.0, 0.0])
    res = weighted_kmeans_1d(x, w, 1)
    assert res.centers[0] == pytest.approx(0.0, abs=1e-15)
    assert res.objective == pytest.approx(0.02)


# --------------------------------------------------------------------------
# fewer atoms than k
# --------------------------------------------------------------------------
def test_fill_when_fewer_atoms_than_k_exact_route():
    res = weighted_kmeans_1d(np.array([0.2, 0.2, -0.4]), np.array([1.0, 2.0, 1.0]), 4)
    assert res.objective == 0.0
    assert res.centers.shape == (4,)
    assert np.all(np.diff(res.centers) >= 0)
    assert {-0.4, 0.2} <= set(res.centers.tolist())
    np.testing.assert_allclose(res.centers, [-0.4, -0.25, -0.1, 0.2])
    assert res.boundaries.tolist() == [0, 1]
    single = weighted_kmeans_1d(np.array([0.3, 0.3]), np.array([1.0, 1.0]), 3)
    np.testing.assert_array_equal(single.centers, [0.3, 0.3, 0.3])


def test_fill_when_fewer_atoms_than_k_histogram_route():
    h = WeightedHistogram(bins=8)
    h.add(np.array([0.1, 0.1]), np.array([1.0, 1.0]))
    res = fit_codebook(h, 4)
    assert res.objective == pytest.approx(0.0, abs=1e-15)
    np.testing.assert_allclose(res.centers, [-0.725, -0.45, 0.1, 0.55])
    assert res.boundaries.tolist() == [4]
    again = fit_codebook(h, 4)
    np.testing.assert_array_equal(again.centers, res.centers)


# --------------------------------------------------------------------------
# histogram route
# --------------------------------------------------------------------------
def test_histogram_on_bin_centres_equals_exact_route():
    rng = np.random.default_rng(21)
    h = WeightedHistogram(bins=1024)
    centres = h.bin_centers()
    pick = rng.integers(0, 1024, size=3000)
    pick = np.concatenate([pick, rng.integers(400, 600, size=2000)])  # a denser middle
    x = centres[pick]
    w = rng.uniform(0.1, 2.0, size=x.size)
    h.add(x, w)
    assert h.total_count == x.size and h.clipped == 0
    for k in (1, 2, 4, 8, 16):
        rh = fit_codebook(h, k)
        rx = weighted_kmeans_1d(x, w, k)
        assert _close(rh.objective, rx.objective, rel=1e-9, abs_=1e-9), k
        np.testing.assert_allclose(rh.centers, rx.centers, atol=1e-12)
        assert _close(rh.objective, kmeans_objective(x, w, rh.centers), rel=1e-9, abs_=1e-9)
        assert np.all(np.diff(rh.centers) >= 0)
        assert rh.centers.min() >= -1 and rh.centers.max() <= 1
        # boundaries are bin indices
        assert np.all(h.w[rh.boundaries] > 0)


def test_histogram_objective_includes_within_bin_spread():
    rng = np.random.default_rng(8)
    x = rng.uniform(-1, 1, size=5000)
    w = rng.uniform(0.5, 1.5, size=5000)
    h = WeightedHistogram(bins=16).add(x, w)
    res = fit_codebook(h, 4)
    # exact SSE of the raw data when every bin goes to its cluster's centre
    bins = np.minimum(((x + 1) / 2 * 16).astype(int), 15)
    cluster = np.searchsorted(res.boundaries, bins, side="right") - 1
    exact = float(np.sum(w * (x - res.centers[cluster]) ** 2))
    assert _close(res.objective, exact, rel=1e-9)
    # never better than the unbinned optimum
    assert res.objective >= weighted_kmeans_1d(x, w, 4).objective - 1e-9
    # one cluster: objective is the weighted variance of the raw data
    assert _close(fit_codebook(h, 1).objective, _sse(x, w), rel=1e-9)


def test_histogram_torch_matches_numpy_and_accumulates():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8, 16)).astype(np.float32) * 0.5
    w = rng.uniform(0, 1, size=x.shape).astype(np.float32)
    hn = WeightedHistogram(bins=64).add(x, w)
    ht = WeightedHistogram(bins=64).add(torch.from_numpy(x), torch.from_numpy(w))
    for name in ("w", "wx", "wx2"):
        np.testing.assert_allclose(getattr(ht, name), getattr(hn, name), rtol=1e-12, atol=1e-12)
        assert getattr(hn, name).dtype == np.float64
    np.testing.assert_array_equal(ht.count, hn.count)
    # adding in two halves equals adding all at once
    h2 = WeightedHistogram(bins=64).add(x[:2], w[:2]).add(x[2:], w[2:])
    np.testing.assert_allclose(h2.wx2, hn.wx2, rtol=1e-12, atol=1e-15)
    merged = WeightedHistogram(bins=64).add(x[:2], w[:2]).merge(WeightedHistogram(bins=64).add(x[2:], w[2:]))
    np.testing.assert_allclose(merged.w, hn.w, rtol=1e-12)


def test_histogram_clips_out_of_range_values():
    h = WeightedHistogram(bins=4)
    h.add(np.array([-5.0, 5.0, 0.1]), np.array([1.0, 2.0, 1.0]))
    assert h.clipped == 2
    assert h.count.tolist() == [1, 0, 1, 1]
    assert h.wx[0] == -1.0 and h.wx[3] == 2.0
    assert h.wx2[3] == 2.0
    res = fit_codebook(h, 3)
    np.testing.assert_allclose(res.centers, [-1.0, 0.1, 1.0])
    assert res.centers.min() >= -1.0 and res.centers.max() <= 1.0


# --------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, -1, 2.5, True, "4"])
def test_bad_k(k):
    with pytest.raises(ValueError, match="k must"):
        weighted_kmeans_1d(np.array([0.0, 1.0]), np.array([1.0, 1.0]), k)
    h = WeightedHistogram(8).add(np.array([0.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="k must"):
        fit_codebook(h, k)


def test_bad_data():
    x = np.array([0.0, 0.5, 1.0])
    w = np.ones(3)
    with pytest.raises(ValueError, match="NaN or Inf"):
        weighted_kmeans_1d(np.array([0.0, np.nan, 1.0]), w, 2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        weighted_kmeans_1d(x, np.array([1.0, np.inf, 1.0]), 2)
    with pytest.raises(ValueError, match="non-negative"):
        weighted_kmeans_1d(x, np.array([1.0, -0.1, 1.0]), 2)
    with pytest.raises(ValueError, match="same shape"):
        weighted_kmeans_1d(x, np.ones(4), 2)
    with pytest.raises(ValueError, match="total weight is zero"):
        weighted_kmeans_1d(x, np.zeros(3), 2)
    with pytest.raises(ValueError, match="total weight is zero"):
        weighted_kmeans_1d(np.array([]), np.array([]), 1)
    with pytest.raises(ValueError, match="same shape"):
        kmeans_objective(x, np.ones(2), [0.0])
    with pytest.raises(ValueError, match="centers"):
        kmeans_objective(x, w, [])


def test_bad_histogram_inputs():
    h = WeightedHistogram(16)
    with pytest.raises(ValueError, match="NaN or Inf"):
        h.add(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        h.add(torch.tensor([0.0]), torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="non-negative"):
        h.add(torch.tensor([0.0, 0.1]), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="same shape"):
        h.add(np.zeros((2, 3)), np.ones(6))
    assert h.total_count == 0  # failed adds left nothing behind
    with pytest.raises(ValueError, match="zero total weight"):
        fit_codebook(h, 2)
    h.add(np.array([0.0, 0.5]), np.zeros(2))
    with pytest.raises(ValueError, match="zero total weight"):
        fit_codebook(h, 2)
    with pytest.raises(ValueError):
        WeightedHistogram(0)
    with pytest.raises(ValueError):
        WeightedHistogram(8, lo=1.0, hi=-1.0)
    with pytest.raises(ValueError, match="different grids"):
        WeightedHistogram(8).merge(WeightedHistogram(16))


# --------------------------------------------------------------------------
# result type and scale
# --------------------------------------------------------------------------
def test_result_is_frozen_and_read_only():
    res = weighted_kmeans_1d(np.array([0.0, 0.5, 1.0]), None, 2)
    assert isinstance(res, KMeansResult)
    with pytest.raises(AttributeError):
        res.objective = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        res.centers[0] = 3.0


def test_large_histogram_runs():
    """65536 bins, k = 16 (no timing assertion: the machine is shared)."""
    rng = np.random.default_rng(0)
    x = np.clip(rng.standard_normal(200_000) * 0.3, -1.0, 1.0)
    w = rng.exponential(1.0, size=x.size)
    h = WeightedHistogram(bins=65536).add(x, w)
    res = fit_codebook(h, 16)
    assert res.centers.shape == (16,)
    assert np.all(np.diff(res.centers) > 0)
    assert res.objective >= weighted_kmeans_1d(x, w, 16).objective - 1e-9
    # nearest-centre reassignment can only help, and by little on a fine grid
    nearest = kmeans_objective(x, w, res.centers)
    assert nearest <= res.objective * (1 + 1e-12)
    assert _close(res.objective, nearest, rel=1e-3)
