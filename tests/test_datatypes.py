"""Tests for kvsqueeze.numerics.datatypes: uniform intX, NormalFloat nfX levels and codebook validation."""

from __future__ import annotations

from statistics import NormalDist

import pytest
import torch

from kvsqueeze.numerics.datatypes import check_codebook, standard_levels, normal_float_levels, uniform_levels

# NF4 as published with QLoRA (Dettmers et al., 2023, Appendix E / bitsandbytes' table).
QLORA_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]


def nf_reference(bits: int) -> list[float]:
    """NormalFloat from its definition, with the standard library's normal quantile function.

    2**(b-1) positive and 2**(b-1) - 1 negative quantiles of N(0, 1), taken at
    probabilities evenly spaced from 0.5 (excluded) up to 1 - delta, where
    delta is the mean of the half-bin widths 1/(2(n-1)) and 1/(2n); plus an
    exact zero; everything divided by the largest magnitude.
    """
    n = 2**bits
    top = 1.0 - 0.5 * (1.0 / (2 * (n - 1)) + 1.0 / (2 * n))
    inv = NormalDist().inv_cdf
    n_pos, n_neg = n // 2, n // 2 - 1
    pos = [inv(top - i * (top - 0.5) / n_pos) for i in range(n_pos)]
    neg = [-inv(top - i * (top - 0.5) / n_neg) for i in range(n_neg)] if n_neg else []
    levels = sorted(neg + [0.0] + pos)
    m = max(abs(v) for v in levels)
    return [v / m for v in levels]


@pytest.mark.parametrize("family,bits", [("int", b) for b in range(1, 9)] + [("nf", b) for b in range(2, 9)])
def test_levels_sorted_in_range_and_span_both_ends(family, bits):
    lv = standard_levels(family, bits)
    assert lv.dtype == torch.float32
    assert lv.shape == (2**bits,)
    assert torch.all(lv.diff() > 0), "levels must be strictly increasing"
    assert lv.min() >= -1 and lv.max() <= 1
    assert lv[0] == -1.0 and lv[-1] == 1.0


@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_levels_are_evenly_spaced(bits):
    lv = uniform_levels(bits).double()
    steps = lv.diff()
    assert torch.allclose(steps, torch.full_like(steps, 2.0 / (2**bits - 1)), atol=1e-6)
    assert torch.allclose(lv, -lv.flip(0), atol=1e-7), "uniform levels are symmetric about 0"


def test_nf4_matches_the_published_qlora_table():
    got = normal_float_levels(4).double()
    assert torch.allclose(got, torch.tensor(QLORA_NF4, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("bits", range(2, 9))
def test_nf_levels_match_the_normal_quantile_definition(bits):
    got = normal_float_levels(bits).double()
    ref = torch.tensor(nf_reference(bits), dtype=torch.float64)
    assert torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("bits", range(2, 9))
def test_nf_structure(bits):
    lv = normal_float_levels(bits)
    n = 2**bits
    assert (lv == 0).sum() == 1, "NormalFloat has one exact zero"
    assert (lv > 0).sum() == n // 2 and (lv < 0).sum() == n // 2 - 1
    # each side is denser near zero: gaps grow towards the ends
    pos = torch.cat([torch.zeros(1), lv[lv > 0]])
    neg = torch.cat([torch.zeros(1), -lv[lv < 0].flip(0)])
    for side in (pos, neg):
        gaps = side.diff()
        if gaps.numel() > 1:
            assert torch.all(gaps[1:] >= gaps[:-1] - 1e-6)


def test_nf1_spans_both_ends():
    """A 1-bit NormalFloat must still be able to represent negative values.

    `normal_float_levels(1)` currently returns [0, 1] (one positive quantile
    plus the zero, no negative one), so a whole negative half of every vector
    collapses onto the zero-point. `_check_bits` accepts 1 bit, so either nf1
    should be rejected or it should be {-1, 1}.
    """
    try:
        lv = normal_float_levels(1)
    except ValueError:
        return  # rejecting 1-bit NormalFloat is an acceptable fix
    assert lv[0] == -1.0 and lv[-1] == 1.0


@pytest.mark.parametrize("bad", [0, 9, -1, 2.0, "3", None])
@pytest.mark.parametrize("fn", [uniform_levels, normal_float_levels])
def test_bad_bits_rejected(fn, bad):
    with pytest.raises(ValueError, match="bit width"):
        fn(bad)


def test_unknown_family_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'int'.*'nf'|\['int', 'nf'\]"):
        standard_levels("nuq", 3)


def test_check_codebook_accepts_a_valid_one():
    cb = torch.tensor([-1.0, -0.2, 0.1, 1.0], dtype=torch.float64)
    out = check_codebook(cb, 2)
    assert out.dtype == torch.float32 and torch.equal(out, cb.float())


@pytest.mark.parametrize(
    "levels,bits,match",
    [
        ([-1.0, 0.0, 1.0], 2, "needs 4 levels"),
        ([-1.0, 0.5, 0.0, 1.0], 2, "sorted"),
        ([-1.5, 0.0, 0.5, 1.0], 2, r"\[-1, 1\]"),
        ([-1.0, 0.0, 0.5, 1.2], 2, r"\[-1, 1\]"),
        ([-1.0, float("nan"), 0.5, 1.0], 2, "NaN"),
        ([-1.0, 0.0, 0.5, float("inf")], 2, "NaN or Inf"),
    ],
)
def test_check_codebook_rejects(levels, bits, match):
    with pytest.raises(ValueError, match=match):
        check_codebook(torch.tensor(levels), bits)


def test_check_codebook_rejects_2d():
    with pytest.raises(ValueError, match="levels"):
        check_codebook(torch.zeros(2, 2), 2)
