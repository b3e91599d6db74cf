"""Tests for kvsqueeze.schemes: VectorQuantizer and build_quantizers (method + recipe -> quantizers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CHANNELS
from kvsqueeze.numerics.datatypes import normal_float_levels, uniform_levels
from kvsqueeze.methods import MethodError, parse_method
from kvsqueeze.numerics.affine import choose_qparams
from kvsqueeze.recipe import RecipeError
from kvsqueeze.methods import build_quantizers
from kvsqueeze.numerics.quantizer import VectorQuantizer


def test_fp16_has_no_quantizers():
    assert build_quantizers(parse_method("fp16"), None, 0, CHANNELS) == (None, None)


@pytest.mark.parametrize("name", ["nuq3", "nuq2-1%", "int3:kchan:pre", "int3:vchan", "int3-1%:pm"])
def test_recipe_methods_without_a_recipe(name):
    with pytest.raises(RecipeError, match=r"offline calibration statistics: pass --recipe DIR"):
        build_quantizers(parse_method(name), None, 0, CHANNELS)


@pytest.mark.parametrize("name", ["nuq3:post", "nuq3:ktok", "nuq3-1%:vchan"])
def test_nuq_on_other_axes_is_a_method_error(name, tiny_recipe):
    with pytest.raises(MethodError, match=r"nuq codebooks are calibrated for per-channel pre-RoPE keys"):
        build_quantizers(parse_method(name), tiny_recipe, 0, CHANNELS)


def test_int_and_nf_baselines_need_no_recipe():
    k, v = build_quantizers(parse_method("int3"), None, 0, CHANNELS)
    assert k.axis == v.axis == "token" and k.bits == v.bits == 3
    assert torch.equal(k.levels, uniform_levels(3))
    k, v = build_quantizers(parse_method("nf-k4v2"), None, 1, CHANNELS)
    assert torch.equal(k.levels, normal_float_levels(4)) and torch.equal(v.levels, normal_float_levels(2))


def test_nuq_quantizers_read_the_recipe(tiny_recipe):
    k, v = build_quantizers(parse_method("nuq-k3v2-1%"), tiny_recipe, 1, CHANNELS)
    assert (k.axis, v.axis) == ("channel", "token") and (k.bits, v.bits) == (3, 2)
    assert k.fraction == pytest.approx(0.01) and v.fraction == pytest.approx(0.01)
    assert torch.equal(k.levels, tiny_recipe.codebook(1, "k", 3, 0.01, "vector", "fs2"))
    assert torch.equal(v.levels, tiny_recipe.codebook(1, "v", 2, 0.01, "vector", "fs2"))
    lo, hi = tiny_recipe.channel_range(1, "k_pre", 0.01)
    assert torch.equal(k.lo, lo) and torch.equal(k.hi, hi)
    unw, _ = build_quantizers(parse_method("nuq3:unw"), tiny_recipe, 0, CHANNELS)
    assert torch.equal(unw.levels, tiny_recipe.codebook(0, "k", 3, 0.0, "vector", "unw"))


def test_per_matrix_channel_range_is_clamped(tiny_recipe):
    k, v = build_quantizers(parse_method("nuq3-1%:pm"), tiny_recipe, 0, CHANNELS)
    lo0, hi0 = tiny_recipe.channel_range(0, "k_pre", 0.0)
    t_lo, t_hi = tiny_recipe.matrix_thresholds(0, "k_pre", 0.01)
    assert torch.equal(k.lo, torch.maximum(lo0, t_lo)) and torch.equal(k.hi, torch.minimum(hi0, t_hi))
    assert v.scope == "matrix" and v.mat_lo == pytest.approx(float(tiny_recipe.matrix_thresholds(0, "v", 0.01)[0]))


def test_post_rope_per_channel_keys_use_post_rope_ranges(tiny_recipe):
    k, _ = build_quantizers(parse_method("int3:kchan"), tiny_recipe, 0, CHANNELS)
    lo, hi = tiny_recipe.channel_range(0, "k_post", 0.0)
    assert torch.equal(k.lo, lo) and torch.equal(k.hi, hi)


def test_kivi_keys_are_left_to_attention():
    k, v = build_quantizers(parse_method("kivi2"), None, 0, CHANNELS)
    assert k is None and v.group == 32 and v.bits == 2


# ---- VectorQuantizer ---------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), c=st.integers(2, 70), bits=st.integers(2, 4), seed=st.integers(0, 9999))
def test_token_axis_encode_decode(n, c, bits, seed):
    x = torch.randn(n, c, generator=torch.Generator().manual_seed(seed)) * 3
    q = VectorQuantizer(uniform_levels(bits), "token")
    enc = q.encode(x)
    assert enc.codes.dtype == torch.uint8 and enc.codes.shape == (n, c) and int(enc.codes.max()) < 2**bits
    assert enc.outliers is None
    assert enc.scale.shape == (n, 1)
    out = q.decode(enc)
    bound = enc.scale / (2**bits - 1) + 2.0**-9 * x.abs().amax(1, keepdim=True) + 1e-6
    assert torch.all((out - x).abs() <= bound)
    assert torch.equal(q.fake(x)[0], out)


def test_decode_without_exact_values_ignores_the_outlier_mask():
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    q = VectorQuantizer(uniform_levels(2), "token", fraction=0.04)
    enc = q.encode(x)
    assert enc.outliers.sum() == 4 * 4
    dense = q.decode(enc)
    full = q.decode(enc, x)
    assert torch.equal(dense[~enc.outliers], full[~enc.outliers])
    assert torch.equal(full[enc.outliers], x[enc.outliers].half().float())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 4), c=st.sampled_from([8, 32, 40, 100, 192]), g=st.sampled_from([8, 32, 128]),
       seed=st.integers(0, 9999))
def test_grouped_scales_come_from_each_group_alone(n, c, g, seed):
    """Every group's (s, z) must come from its own elements only.

    `_encode_grouped` pads a row whose width is not a multiple of the group with
    the row's *first* value; that value lands in the last group and can widen its
    range (e.g. 192 channels in groups of 128 — SmolLM2 with `group3`). Padding
    with an element of the last group (e.g. the row's last value) would not.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=gen)
    x[:, 0] = 50.0  # a large first channel
    q = VectorQuantizer(uniform_levels(3), "token", group=g)
    enc = q.encode(x)
    assert enc.codes.shape == (n, c) and enc.scale.shape == (n, c)
    for start in range(0, c, g):
        part = x[:, start : start + g]
        s, z = choose_qparams(part.amin(1, keepdim=True), part.amax(1, keepdim=True))
        assert torch.equal(enc.scale[:, start : start + g], s.expand_as(part)), f"group at {start}"
        assert torch.equal(enc.zero[:, start : start + g], z.expand_as(part)), f"group at {start}"
    out = q.decode(enc)
    assert torch.all((out - x).abs() <= enc.scale / 7 + 2.0**-9 * 50 + 1e-6)


def test_grouped_beats_whole_token_on_channel_outliers():
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 30
    whole = VectorQuantizer(uniform_levels(3), "token").fake(x)[0]
    grouped = VectorQuantizer(uniform_levels(3), "token", group=32).fake(x)[0]
    assert (grouped - x).pow(2).mean() < (whole - x).pow(2).mean() / 2


def test_bits_property():
    for b in (2, 3, 4, 8):
        assert VectorQuantizer(uniform_levels(b), "token").bits == b


def test_key_slots_keep_a_fixed_count_outliers_first():
    """':kslotsN': every token keeps exactly N exact key elements, its outliers first (the farthest when it has
    more), then the in-range elements its codes round worst; its storage counts N per token, no pointers."""
    from kvsqueeze.numerics.datatypes import uniform_levels
    from conftest import layer_bits as storage_bits
    from kvsqueeze.methods import parse_method

    g = torch.Generator().manual_seed(0)
    c = 48
    lo, hi = -torch.ones(c), torch.ones(c)
    q = VectorQuantizer(levels=uniform_levels(3), axis="channel", fraction=0.01, lo=lo, hi=hi, slots=3)
    x = torch.rand(64, c, generator=g) * 1.8 - 0.9  # in range
    x[0, :5] = torch.tensor([1.5, -3.0, 1.1, 2.0, -1.2])  # five outliers: the three farthest kept
    x[1, 7] = 4.0  # one outlier and two in-range elements
    enc = q.encode(x)
    assert bool((enc.outliers.sum(1) == 3).all())
    assert enc.outliers[0].nonzero().flatten().tolist() == [0, 1, 3]  # 0.5, 2.0 and 1.0 past the range
    assert bool(enc.outliers[1, 7])
    err = (q.decode(enc) - x).abs()
    err[1, 7] = 0
    kept = enc.outliers[1].clone()
    kept[7] = False
    assert float(err[1][kept].min()) >= float(err[1][~enc.outliers[1]].max())  # the worst-rounded ones
    spec = parse_method("nuq3-1%:kslots3")
    assert spec.name == "nuq3-1%:kslots3" and parse_method(spec.name) == spec
    bits = storage_bits(spec, 100, c)
    plain = storage_bits(parse_method("nuq3-1%"), 100, c)
    assert bits["outlier_values"] == 16 * 3 * 99 == plain["outlier_values"] + 16 * (3 * 99 - round(0.01 * 99 * c))
    # a fixed count needs no row pointers; plain per-channel key outliers vary in count: one per slot and one
    assert bits["pointers"] == 0 and plain["pointers"] == 32 * 100
