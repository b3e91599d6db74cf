"""`experiments/key_probes.py` measures the recipe's own error: its plain quantizer's Fisher-weighted error is the
per-channel error calibration records (to its bins' rounding), and its per-head and range-searched variants reduce to it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvsqueeze.calibrate.channels import channel_histograms
from kvsqueeze.calibrate.fit import _normalized

SCRIPT = Path(__file__).parents[2] / "experiments" / "key_probes.py"


@pytest.fixture(scope="module")
def probes():
    spec = importlib.util.spec_from_file_location("key_probes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(seed=0, n=300, c=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g) * torch.linspace(0.5, 3.0, c)
    x[::37, 2] += 15.0  # a few outliers
    fisher = torch.rand(n, c, generator=g) + 0.1
    return x, fisher


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("fraction", [0.0, 0.01])
def test_plain_error_is_the_recipes_channel_error(probes, kind, fraction):
    x, fisher = _data()
    part = probes.Part(x, fisher, kind, fraction)
    levels = probes.fitted_levels(x, fisher, part.lo, part.hi, part.inside, 3)
    norm, scale, inside = _normalized(x, part.lo, part.hi, fraction)
    recorded = channel_histograms(norm, fisher * scale.square(), inside, 4096).errors([levels])[:, 0]
    # calibration reads a channel's error off its 4,096 bins: within bin rounding of the element-wise error
    torch.testing.assert_close(part.error(levels).double(), recorded, rtol=2e-3, atol=1e-6)
    # a ratio of one is the plain range, and a held-out part with the fitting part's key ranges keeps them
    torch.testing.assert_close(part.error(levels, torch.ones(1, 1)), part.error(levels))
    if kind == "k":
        held = probes.Part(x + 0.01, fisher, kind, fraction, key_range=(part.lo, part.hi))
        assert torch.equal(held.lo, part.lo) and torch.equal(held.hi, part.hi)


def test_per_head_channels_add_up_to_the_whole(probes):
    x, fisher = _data(1)
    part = probes.Part(x, fisher, "k", 0.01)
    levels = probes.fitted_levels(x, fisher, part.lo, part.hi, part.inside, 3)
    halves = part.error(levels, channels=slice(0, 4)).sum() + part.error(levels, channels=slice(4, 8)).sum()
    torch.testing.assert_close(halves, part.error(levels).sum())


def test_the_search_never_loses_on_the_windows_it_fits(probes):
    x, fisher = _data(2)
    part = probes.Part(x, fisher, "k", 0.0)
    r = probes.probe_layer(part, part, "k", 3, head_dim=4)
    assert r["range_search"][0] <= r["plain"][0] * 1.001
