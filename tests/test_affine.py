"""Tests for kvsqueeze.numerics.quantizer: scale/zero-point choice, quantize, dequantize, fake_quantize."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.numerics.datatypes import standard_levels, normal_float_levels, uniform_levels
from kvsqueeze.numerics.affine import check_finite, choose_qparams, dequantize, fake_quantize, quantize

FAST = settings(max_examples=40, deadline=None)


def per_token_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)


def fp16_slack(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """What storing s and z in fp16 can move the reconstructable range by (a few fp16 ulps)."""
    return 2.0**-9 * torch.maximum(lo.abs(), hi.abs()) + 1e-6


def sqnr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    return 10 * math.log10(float(x.pow(2).sum()) / max(float((x - xq).pow(2).sum()), 1e-30))


@st.composite
def matrices(draw):
    n = draw(st.integers(1, 6))
    c = draw(st.integers(2, 48))
    seed = draw(st.integers(0, 2**16))
    mag = draw(st.sampled_from([1e-3, 1.0, 30.0, 1000.0]))
    shift = draw(st.sampled_from([0.0, 1.0, -5.0]))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, generator=g) + shift) * mag


@FAST
@given(x=matrices(), bits=st.integers(2, 8))
def test_uniform_round_trip_error_bound(x, bits):
    lo, hi = per_token_range(x)
    levels = uniform_levels(bits)
    scale, zero = choose_qparams(lo, hi)
    xq = fake_quantize(x, lo, hi, levels)
    bound = scale / (2**bits - 1) + fp16_slack(lo, hi)
    assert torch.all((x - xq).abs() <= bound)


@FAST
@given(x=matrices(), bits=st.integers(2, 4), family=st.sampled_from(["int", "nf"]))
def test_codes_in_range_and_dequantize_is_a_level(x, bits, family):
    levels = standard_levels(family, bits)
    lo, hi = per_token_range(x)
    scale, zero = choose_qparams(lo, hi)
    codes = quantize(x * 3, scale, zero, levels)  # most values far outside the range
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert int(codes.max()) < 2**bits
    deq = dequantize(codes, scale, zero, levels)
    assert torch.allclose(deq, levels[codes.long()] * scale + zero)


def test_values_outside_the_range_clip_to_the_end_levels():
    levels = normal_float_levels(3)
    lo, hi = torch.tensor([[-1.0], [2.0]]), torch.tensor([[3.0], [2.5]])
    x = torch.tensor([[-50.0, -1.5, 3.5, 1e6], [0.0, 1.9, 2.6, 100.0]])
    scale, zero = choose_qparams(lo, hi)
    codes = quantize(x, scale, zero, levels)
    below = x < lo
    assert torch.all(codes[below] == 0)
    assert torch.all(codes[~below] == 2**3 - 1)
    xq = fake_quantize(x, lo, hi, levels)
    assert torch.allclose(xq[0], torch.tensor([-1.0, -1.0, 3.0, 3.0]), atol=1e-3)
    assert torch.allclose(xq[1], torch.tensor([2.0, 2.0, 2.5, 2.5]), atol=1e-3)


@FAST
@given(x=matrices(), bits=st.integers(2, 4), family=st.sampled_from(["int", "nf"]), seed=st.integers(0, 999))
def test_keep_mask_returns_exact_fp16_values(x, bits, family, seed):
    levels = standard_levels(family, bits)
    lo, hi = x.quantile(0.25, dim=-1, keepdim=True), x.quantile(0.75, dim=-1, keepdim=True)
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.3
    xq = fake_quantize(x, lo, hi, levels, keep=keep)
    plain = fake_quantize(x, lo, hi, levels)
    assert torch.equal(xq[keep], x[keep].half().float())
    assert torch.equal(xq[~keep], plain[~keep])


@FAST
@given(x=matrices(), bits=st.integers(2, 4), family=st.sampled_from(["int", "nf"]))
def test_quantize_dequantize_is_idempotent(x, bits, family):
    levels = standard_levels(family, bits)
    lo, hi = per_token_range(x)
    once = fake_quantize(x, lo, hi, levels)
    twice = fake_quantize(once, lo, hi, levels)
    assert torch.equal(once, twice)


def test_nearest_level_on_a_non_uniform_codebook():
    levels = torch.tensor([-1.0, -0.7, -0.1, 0.0, 0.05, 0.3, 0.9, 1.0])
    norm = torch.linspace(-1.3, 1.3, 2001)
    codes = quantize(norm, torch.ones(()), torch.zeros(()), levels)
    dist = (norm[:, None] - levels[None, :]).abs()
    best = dist.min(1).values
    got = dist.gather(1, codes.long()[:, None]).squeeze(1)
    assert torch.allclose(got, best, atol=1e-6)


@pytest.mark.parametrize("family", ["int", "nf"])
@pytest.mark.parametrize("shape", [(64, 128), (7, 33), (300, 16)])
@pytest.mark.parametrize("axis", [0, -1])
def test_sqnr_increases_with_bits(family, shape, axis):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.rand(shape[1], generator=g) * 4 + 0.5
    lo, hi = x.amin(axis, keepdim=True), x.amax(axis, keepdim=True)
    sqnr = [sqnr_db(x, fake_quantize(x, lo, hi, standard_levels(family, b))) for b in (2, 3, 4)]
    assert sqnr[0] < sqnr[1] < sqnr[2], sqnr
    assert sqnr[2] - sqnr[0] > 6, f"two more bits should buy well over 6 dB, got {sqnr}"


def test_uniform_sqnr_close_to_theory_on_uniform_data():
    # uniform data on the full range: each extra bit adds ~6.02 dB
    x = torch.rand(256, 256, generator=torch.Generator().manual_seed(0)) * 2 - 1
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    s = [sqnr_db(x, fake_quantize(x, lo, hi, uniform_levels(b))) for b in (2, 3, 4, 8)]
    for a, b in zip(s, s[1:3]):
        assert 5.0 < b - a < 7.5, s
    assert s[3] > 45


def test_choose_qparams_is_fp16_representable_and_covers_the_range():
    g = torch.Generator().manual_seed(1)
    lo = torch.randn(100, generator=g) * 10
    hi = lo + torch.rand(100, generator=g) * 5
    scale, zero = choose_qparams(lo, hi)
    assert scale.dtype == torch.float32 and zero.dtype == torch.float32
    assert torch.equal(scale, scale.half().float()) and torch.equal(zero, zero.half().float())
    assert torch.all(scale > 0)
    assert torch.all((zero - scale - lo).abs() <= fp16_slack(lo, hi))
    assert torch.all((zero + scale - hi).abs() <= fp16_slack(lo, hi))


def test_constant_vector_reconstructs_to_fp16():
    x = torch.full((3, 10), 7.123)
    x[1] = -0.0003
    x[2] = 0.0
    lo, hi = per_token_range(x)
    xq = fake_quantize(x, lo, hi, uniform_levels(2))
    assert torch.isfinite(xq).all()
    assert torch.allclose(xq, x, atol=2e-6, rtol=2.0**-10)


def test_fake_quantize_keeps_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    lo, hi = per_token_range(x)
    assert fake_quantize(x, lo, hi, uniform_levels(3)).dtype == torch.bfloat16


def test_check_finite():
    check_finite(torch.ones(3), "ok")
    x = torch.ones(5)
    x[1] = float("nan")
    x[3] = float("inf")
    with pytest.raises(FloatingPointError, match=r"layer 3 keys holds 2 NaN/Inf"):
        check_finite(x, "layer 3 keys")
