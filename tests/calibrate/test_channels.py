import numpy as np
import pytest
import torch

from kvsqueeze.calibrate.channels import channel_histograms
from kvsqueeze.calibrate.kmeans import WeightedHistogram, fit_codebook


def _data(n=3000, c=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g) * 0.4).clamp(-1.2, 1.2)  # a few beyond [-1, 1]: clipped like the others
    w = torch.rand(n, c, generator=g)
    inside = torch.rand(n, c, generator=g) > 0.05
    return x, w, inside


def test_channel_histograms_sum_to_the_layer_histogram():
    x, w, inside = _data()
    hists = channel_histograms(x, w, inside, bins=256)
    ref = WeightedHistogram(bins=256).add(x[inside], w[inside])
    whole = hists.whole()
    np.testing.assert_allclose(whole.w, ref.w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(whole.wx, ref.wx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(whole.wx2, ref.wx2, rtol=1e-12, atol=1e-12)
    assert np.array_equal(whole.count, ref.count)
    for j in range(x.shape[1]):  # and each channel's grid is that channel's histogram
        one = WeightedHistogram(bins=256).add(x[:, j][inside[:, j]], w[:, j][inside[:, j]])
        np.testing.assert_allclose(hists.w[j], one.w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits", [1, 2, 4, 6])
def test_channel_errors_match_the_elementwise_error(bits):
    """Each channel's error at a codebook, from its bins, is within bin rounding of sum w (x - c(x))^2."""
    x, w, inside = _data(n=20000, c=4, seed=bits)
    hists = channel_histograms(x, w, inside, bins=4096)
    levels = torch.tensor(fit_codebook(hists.whole(), 2**bits).centers, dtype=torch.float32)
    got = hists.errors([levels])[:, 0]
    xc = x.clamp(-1, 1)
    idx = torch.bucketize(xc, (levels[1:] + levels[:-1]) / 2)
    want = (w * inside * (xc - levels[idx]).square()).double().sum(0)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-6)
    # the codebook fitted to the whole histogram is the one the errors favour: a worse one costs more
    worse = levels * 0.8
    assert torch.all(hists.errors([worse])[:, 0].sum() > got.sum())
