"""Tests for kvsqueeze.numerics.outliers (dense-and-sparse thresholds) and outlier handling in VectorQuantizer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.numerics.datatypes import standard_levels, uniform_levels
from kvsqueeze.methods import max_outliers_per_side
from kvsqueeze.numerics.outliers import calibrated_thresholds, clamp_range, online_thresholds, outlier_mask
from kvsqueeze.numerics.affine import choose_qparams
from kvsqueeze.numerics.quantizer import VectorQuantizer

FAST = settings(max_examples=40, deadline=None)


@st.composite
def data(draw, ties=True):
    n = draw(st.integers(1, 8))
    c = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if ties and draw(st.booleans()):
        x = torch.randint(-3, 4, (n, c), generator=g).float()  # many ties
    else:
        x = torch.randn(n, c, generator=g) * torch.rand(c, generator=g).add(0.1)
        spikes = torch.rand(n, c, generator=g) < 0.02
        x = torch.where(spikes, x * 50, x)
    return x


@FAST
@given(x=data(), fraction=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2, 0.45]), dim=st.sampled_from([0, 1, -1]))
def test_online_thresholds_leave_at_most_k_per_side(x, fraction, dim):
    n = x.shape[dim]
    k = max_outliers_per_side(fraction, n)
    lo, hi = online_thresholds(x, fraction, dim=dim)
    assert lo.shape[dim] == 1 and hi.shape[dim] == 1
    assert torch.all(lo <= hi)
    assert torch.all((x > hi).sum(dim) <= k)
    assert torch.all((x < lo).sum(dim) <= k)
    # the range is never wider than the vector itself
    assert torch.all(lo >= x.amin(dim, keepdim=True)) and torch.all(hi <= x.amax(dim, keepdim=True))


@FAST
@given(x=data(ties=False), fraction=st.sampled_from([0.01, 0.05, 0.2]))
def test_online_thresholds_exactly_k_per_side_without_ties(x, fraction):
    n = x.shape[1]
    k = min(max_outliers_per_side(fraction, n), (n - 1) // 2)
    lo, hi = online_thresholds(x, fraction, dim=1)
    assert torch.all((x > hi).sum(1) == k)
    assert torch.all((x < lo).sum(1) == k)


def test_online_thresholds_without_outliers_are_min_max():
    x = torch.randn(5, 17)
    lo, hi = online_thresholds(x, 0.0, dim=1)
    assert torch.equal(lo, x.amin(1, keepdim=True)) and torch.equal(hi, x.amax(1, keepdim=True))


def test_online_thresholds_pick_the_right_tails():
    x = torch.arange(200.0)[torch.randperm(200, generator=torch.Generator().manual_seed(0))].view(1, 200)
    lo, hi = online_thresholds(x, 0.02, dim=1)  # 2 per side
    assert lo.item() == 2.0 and hi.item() == 197.0
    assert outlier_mask(x, lo, hi).sum() == 4


@FAST
@given(x=data(), fraction=st.sampled_from([0.01, 0.05, 0.2]), bits=st.integers(2, 4),
       family=st.sampled_from(["int", "nf"]))
def test_token_outliers_reconstructed_exactly(x, fraction, bits, family):
    q = VectorQuantizer(standard_levels(family, bits), "token", fraction=fraction)
    xq, n_out = q.fake(x)
    lo, hi = online_thresholds(x, fraction, dim=1)
    mask = outlier_mask(x, lo, hi)
    # every element strictly outside the thresholds is exact, and each token keeps exactly k per side
    assert torch.equal(xq[mask], x[mask].half().float())
    k = min(max_outliers_per_side(fraction, x.shape[1]), (x.shape[1] - 1) // 2)
    assert torch.all(mask.sum(1) <= 2 * k)
    assert n_out == 2 * k * x.shape[0]
    # inliers are quantized inside the narrowed range: error at most half the widest level gap
    levels = standard_levels(family, bits)
    scale, _ = choose_qparams(lo, hi)
    half_gap = float(levels.diff().max()) / 2
    bound = (scale * half_gap + 2.0**-9 * torch.maximum(lo.abs(), hi.abs()) + 1e-6).expand_as(x)
    assert torch.all((xq - x).abs()[~mask] <= bound[~mask])


def test_outliers_are_what_makes_the_rest_accurate():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g)
    x[:, 5] *= 40  # one huge channel inflates every token's range
    plain, _ = VectorQuantizer(uniform_levels(3), "token").fake(x)
    sparse, n = VectorQuantizer(uniform_levels(3), "token", fraction=0.02).fake(x)
    assert n > 0
    err_plain = (plain - x).pow(2).mean()
    err_sparse = (sparse - x).pow(2).mean()
    assert err_sparse < err_plain / 20


def test_channel_axis_outliers_against_offline_ranges():
    g = torch.Generator().manual_seed(4)
    calib = torch.randn(1000, 12, generator=g) * torch.linspace(0.1, 3, 12)
    lo, hi = calibrated_thresholds(calib, 0.01, dim=0)
    x = torch.randn(50, 12, generator=g) * torch.linspace(0.1, 3, 12) * 1.5
    q = VectorQuantizer(uniform_levels(4), "channel", fraction=0.01, lo=lo, hi=hi)
    xq, n = q.fake(x)
    mask = (x < lo) | (x > hi)
    assert n == int(mask.sum()) > 0
    assert torch.equal(xq[mask], x[mask].half().float())
    scale, _ = choose_qparams(lo, hi)
    bound = (scale / 15 + 2.0**-9 * torch.maximum(lo.abs(), hi.abs()) + 1e-6).expand_as(x)
    assert torch.all((xq - x).abs()[~mask] <= bound[~mask])


def test_calibrated_thresholds_are_quantiles_per_channel():
    n, c = 1000, 6
    g = torch.Generator().manual_seed(5)
    # column j holds the values j, j+1, ..., j+999 in random order
    x = torch.stack([torch.randperm(n, generator=g).float() + j for j in range(c)], dim=1)
    lo, hi = calibrated_thresholds(x, 0.02, dim=0)  # 1% per side = 10 values
    assert lo.shape == (c,) and hi.shape == (c,)
    assert torch.equal(lo, torch.arange(c).float() + 10)
    assert torch.equal(hi, torch.arange(c).float() + n - 1 - 10)
    lo0, hi0 = calibrated_thresholds(x, 0.0, dim=0)
    assert torch.equal(lo0, x.amin(0)) and torch.equal(hi0, x.amax(0))


@FAST
@given(x=data(ties=False), fraction=st.sampled_from([0.001, 0.01, 0.1]))
def test_calibrated_thresholds_match_empirical_quantiles(x, fraction):
    xt = x.T.contiguous()  # [N, C] with N the long axis
    lo, hi = calibrated_thresholds(xt, fraction, dim=0)
    n = xt.shape[0]
    below = (xt < lo).sum(0)
    above = (xt > hi).sum(0)
    k = int(round(fraction / 2 * n))
    assert torch.all(below == k) and torch.all(above == k)


def test_per_matrix_thresholds_are_scalars_over_all_elements():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(400, 25, generator=g)
    lo, hi = calibrated_thresholds(x, 0.01, dim=None)
    assert lo.ndim == 0 and hi.ndim == 0
    flat = x.flatten()
    k = int(round(0.005 * flat.numel()))
    assert int((flat < lo).sum()) == k and int((flat > hi).sum()) == k


def test_per_matrix_thresholds_without_outliers_are_scalars_too():
    """dim=None promises scalars; with fraction 0 it currently returns shape [1] tensors."""
    x = torch.randn(40, 5)
    lo, hi = calibrated_thresholds(x, 0.0, dim=None)
    assert lo.ndim == 0 and hi.ndim == 0
    assert lo.item() == x.min().item() and hi.item() == x.max().item()


def test_clamp_range_narrows_only():
    x = torch.tensor([[-5.0, 0.0, 1.0], [-0.5, 0.2, 0.4]])
    lo, hi = clamp_range(x, torch.tensor(-1.0), torch.tensor(0.8), dim=1)
    assert torch.equal(lo.squeeze(1), torch.tensor([-1.0, -0.5]))
    assert torch.equal(hi.squeeze(1), torch.tensor([0.8, 0.4]))


def test_per_matrix_scope_quantizer():
    g = torch.Generator().manual_seed(7)
    calib = torch.randn(2000, 16, generator=g)
    t_lo, t_hi = calibrated_thresholds(calib, 0.01, dim=None)
    x = torch.randn(30, 16, generator=g) * 1.2
    q = VectorQuantizer(uniform_levels(3), "token", fraction=0.01, scope="matrix",
                        mat_lo=float(t_lo), mat_hi=float(t_hi))
    xq, n = q.fake(x)
    mask = (x < t_lo) | (x > t_hi)
    assert n == int(mask.sum()) > 0
    assert torch.equal(xq[mask], x[mask].half().float())
    # per-token counts vary with the data (unlike per-vector top-k)
    assert len(set(mask.sum(1).tolist())) > 1


@pytest.mark.parametrize("fraction,width,k", [(0.01, 128, 1), (0.01, 64, 0), (0.01, 100, 1), (0.001, 4096, 2),
                                              (0.1, 32, 2), (0.0, 1000, 0)])
def test_max_outliers_per_side(fraction, width, k):
    assert max_outliers_per_side(fraction, width) == k


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.2])
def test_calibrated_thresholds_are_the_order_statistics_with_ties(fraction):
    """The topk reading returns the (k+1)-th smallest and largest elements, ties included, as kthvalue does."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-20, 20, (3001, 7), generator=g).float()  # many ties
    n = x.shape[0]
    k = int(round(fraction / 2 * n))
    lo, hi = calibrated_thresholds(x, fraction, dim=0)
    assert torch.equal(lo, x.kthvalue(k + 1, dim=0).values) and torch.equal(hi, x.kthvalue(n - k, dim=0).values)
    m_lo, m_hi = calibrated_thresholds(x, fraction, dim=None)
    flat = x.flatten()
    km = int(round(fraction / 2 * flat.numel()))
    assert float(m_lo) == float(flat.kthvalue(km + 1).values) and float(m_hi) == float(
        flat.kthvalue(flat.numel() - km).values)
