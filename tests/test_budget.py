"""Tests for kvsqueeze.methods.budget: the per-layer bit choice of `nuq@AVG` methods.

Its storage model is the compressed cache's own count (`kvsqueeze.storage`, per unit and shared); the choice fits its budget, beats every plain
nuq method of no more bits on the recipe's own predicted loss, grows with the budget, and reaches every path
that stores a cache (simulated, compressed, fused) with the same per-layer bits."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze import storage
from kvsqueeze.methods.budget import KEY_OUTLIER_HEADROOM, Choice, allocate, layer_choices, recipe_allocation, shared_bits, unit_bits
from kvsqueeze.methods import MethodError, average_bits, cache_bytes, parse_method
from kvsqueeze.storage import Rows


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("fraction", [0.0, 0.01])
@pytest.mark.parametrize("tokens, sinks, window", [(2048, 1, 0), (100, 0, 0), (1, 1, 0), (300, 1, 32)])
def test_units_and_the_shared_part_add_up_to_the_cache(bits, fraction, tokens, sinks, window):
    """What the budget charges each unit, plus what every choice pays alike, is the whole cache's count with the
    keys holding `KEY_OUTLIER_HEADROOM` times their nominal outliers."""
    spec = parse_method(f"nuq{bits}" + ("-1%" if fraction else "") + f":sink{sinks}" + (f":r{window}" if window else ""))
    c, layers = 192, 3
    units = layers * (unit_bits("k", Choice(bits, fraction), tokens, c, sinks)
                      + unit_bits("v", Choice(bits, fraction), tokens, c, sinks))
    coded = tokens - min(sinks, tokens)
    k_held = math.ceil(KEY_OUTLIER_HEADROOM * round(fraction * coded * c))
    whole = 8 * storage.total(cache_bytes(spec, layers, c, 64, Rows(tokens), outliers=[(k_held, None)] * layers))
    assert units + shared_bits([tokens] * layers, c, sinks, window, tokens) == whole
    if fraction and coded * c >= 1000:
        assert whole > 8 * storage.total(cache_bytes(spec, layers, c, 64, Rows(tokens)))  # the headroom is charged


@pytest.mark.parametrize("tokens, sinks, window", [(2048, 1, 0), (2048, 4, 32), (6, 1, 0), (300, 1, 32)])
def test_on_sliding_window_layers_the_units_and_the_shared_part_add_up_to_the_cache(tokens, sinks, window):
    """A sliding layer holds its last window - 1 tokens (none of a row's sinks once it has moved past them): what
    the budget charges each unit there at those tokens, plus the shared part, is the registry's count of a cache
    whose sliding layers hold that much (`cache_bytes` with `held`), positions of their own included."""
    from types import SimpleNamespace

    from kvsqueeze.methods.budget import held_sinks, held_tokens

    spec = parse_method(f"nuq3-1%:sink{sinks}" + (f":r{window}" if window else ""))
    c, windows = 192, [64, None, 64]
    recipe = SimpleNamespace(meta={"model": {"fingerprint": {"layers": 3, "layer_windows": windows}}})
    held = held_tokens(recipe, tokens)
    assert held == [min(tokens, 63), tokens, min(tokens, 63)]
    kept = held_sinks(held, sinks, tokens)
    units = sum(unit_bits(kv, Choice(3, 0.01), h, c, s) for h, s in zip(held, kept) for kv in "kv")
    k_held = [math.ceil(KEY_OUTLIER_HEADROOM * round(0.01 * (h - s) * c)) for h, s in zip(held, kept)]
    sliding = [None if w is None else h for w, h in zip(windows, held)]
    whole = 8 * storage.total(cache_bytes(spec, 3, c, 64, Rows(tokens), held=sliding,
                                          outliers=[(k, None) for k in k_held]))
    assert units + shared_bits(held, c, sinks, window, tokens, [w is not None for w in windows]) == whole
    if tokens > 64 + sinks:
        assert kept == [0, sinks, 0]


def _predicted(recipe, spec) -> float:
    fp = recipe.meta["model"]["fingerprint"]
    objective = recipe.meta["kmeans_objective"]
    total = 0.0
    for layer in range(fp["layers"]):
        for kv, bits in (("k", spec.k_bits), ("v", spec.v_bits)):
            pct = "p1" if spec.outlier_fraction else "p0"
            total += objective[f"layers.{layer}.codebook.{kv}.b{bits}.{pct}.vector.fs2"]["nuq"]
    return total


def _avg_bits(recipe, spec, tokens=2048) -> float:
    """The plain method's bits as a budget charges them (its keys' outliers with their headroom): what a budget
    must be given to afford that method in every layer."""
    fp = recipe.meta["model"]["fingerprint"]
    c, layers = fp["kv_heads"] * fp["head_dim"], fp["layers"]
    choice = Choice(spec.k_bits, spec.outlier_fraction)
    units = layers * sum(unit_bits(kv, choice, tokens, c, spec.sinks) for kv in "kv")
    bits = (units + shared_bits([tokens] * layers, c, spec.sinks, 0, tokens)) / (2 * tokens * c * layers)
    nominal = average_bits(spec, layers, c, fp["head_dim"], tokens)
    assert bits > nominal if spec.outlier_fraction else bits == nominal  # key outliers charged above their count
    return bits


@pytest.mark.parametrize("plain", ["nuq2", "nuq2-1%", "nuq3", "nuq3-1%", "nuq4", "nuq4-1%", "nuq-k4v2-1%"])
def test_the_budget_fits_and_beats_plain_nuq_of_no_more_bits_on_predicted_loss(tiny_recipe, plain):
    spec = parse_method(plain)
    avg = _avg_bits(tiny_recipe, spec)
    alloc = allocate(tiny_recipe, avg)
    assert alloc.bits <= avg + 1e-9
    assert alloc.predicted <= _predicted(tiny_recipe, spec) * (1 + 1e-9)


def test_more_bits_never_predict_more_loss_and_the_ends_are_refused_or_saturate(tiny_recipe):
    allocs = [allocate(tiny_recipe, b) for b in (2.9, 3.0, 3.5, 4.0, 4.6, 6.0)]  # 2.78 bits at least: C = 32
    assert all(a.predicted >= b.predicted for a, b in zip(allocs, allocs[1:]))
    top = allocs[-1]
    assert {c.bits for c in top.keys + top.values} == {4}  # everything at its widest choice
    assert len({c.bits for c in allocs[2].keys + allocs[2].values}) > 1  # a real mix in between
    with pytest.raises(MethodError, match="below what this recipe can store"):
        allocate(tiny_recipe, 2.0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_window_that_alone_outgrows_the_budget_is_refused_under_its_own_name(tiny_recipe, per_channel):
    """Every token in fp16 (a window longer than the context) is 16 bits and more: the refusal names the budget
    with its window and the context it was counted at, as the user wrote them."""
    from kvsqueeze.methods.budget import allocate_channels

    fit = allocate_channels if per_channel else allocate
    with pytest.raises(MethodError, match=rf"nuq@3\.5:r500{':chan' if per_channel else ''}: the fp16 sinks and "
                                          r"window alone store more than 3\.5 bits per element at 256 tokens"):
        fit(tiny_recipe, 3.5, tokens=256, window=500)


def test_the_recipe_keeps_a_stored_choice_and_computes_the_same_one_otherwise(tiny_recipe):
    import copy

    alloc = recipe_allocation(tiny_recipe, 3.0)
    assert alloc == allocate(tiny_recipe, 3.0)
    stored = copy.deepcopy(tiny_recipe)
    edited = alloc.as_dict()
    edited["keys"][0] = [2, 0.0]  # a stored choice is read as it is
    stored.meta["budgets"] = {"3": edited}
    assert recipe_allocation(stored, 3.0).keys[0] == Choice(2, 0.0)
    assert layer_choices(parse_method("nuq@3"), stored, 0)[0] == Choice(2, 0.0)


def test_budget_methods_store_and_count_their_own_layer_bits(tiny_llama, tiny_recipe):
    """Simulated, compressed and fused paths build each layer from its choice: the same logits, the bits counted
    as the stores hold them."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    spec = parse_method("nuq@3")
    alloc = recipe_allocation(tiny_recipe, 3.0)
    ids = random_ids(1, 30, seed=4)
    with torch.no_grad():
        with SimulatedQuantization(tiny_llama, spec, tiny_recipe) as sim:
            ref = tiny_llama(ids, cache=sim.new_cache(), use_cache=True).logits
            bits = sim.storage(30)
        cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq@3")
        got = torch.cat([tiny_llama(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(30)], 1)
        for i, layer in enumerate(cache.layers):
            assert (layer.store.k_bits, layer.store.v_bits) == (alloc.keys[i].bits, alloc.values[i].bits)
        cache2 = kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq@3")
        with fused_decode(tiny_llama, cache2):
            fused = tiny_llama.generate(ids[:, :20], cache=cache2, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                        pad_token_id=0)
        dense = tiny_llama.generate(ids[:, :20], cache=kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq@3"),
                                    max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused, dense)
    assert bits == cache.memory_report().components  # the simulated path counts what the cache holds


def test_budget_names_and_refusals(tiny_recipe):
    assert parse_method("nuq@3.0").name == "nuq@3" and parse_method("nuq@2.6:sink0").sinks == 0
    for bad, match in (("int@3", "nuq codebooks"), ("nuq@3-1%", "drop the bit width"), ("nuq@1", "between 2"),
                       ("nuq@3:pm", "a sink count")):
        with pytest.raises(MethodError, match=match):
            parse_method(bad)
    with pytest.raises(Exception, match="pass --recipe"):
        layer_choices(parse_method("nuq@3"), None, 0)


def test_measured_sensitivities_drive_kl_budgets(tiny_llama, tiny_recipe):
    """`measure_sensitivity` quantizes one tensor of one layer at a time: every entry is a KL divergence, fewer
    bits never cost less on the same tensor; a ':kl' budget reads them, and refuses a recipe without them."""
    import copy

    from conftest import random_ids

    from kvsqueeze.methods.budget import sensitivity_key
    from kvsqueeze.calibrate.sensitivity import measure_sensitivity
    from kvsqueeze.recipe import RecipeError

    recipe = copy.deepcopy(tiny_recipe)
    with pytest.raises(RecipeError, match="kvsqueeze budget"):
        allocate(recipe, 3.0, proxy="kl")
    table = measure_sensitivity(tiny_llama, recipe, random_ids(2, 48, seed=9), progress=False)
    kl = table["kl"]
    assert len(kl) == 2 * 2 * 9 and all(v >= 0 for v in kl.values())
    for layer in range(2):
        for kv in "kv":
            assert kl[f"{layer}.{kv}.2.0"] > kl[f"{layer}.{kv}.4.0"]
    recipe.meta["sensitivity"] = {sensitivity_key(1): table}
    alloc = allocate(recipe, 3.0, proxy="kl")
    assert alloc.bits <= 3.0 + 1e-9
    spec = parse_method("nuq@3:kl")
    assert spec.name == "nuq@3:kl" and layer_choices(spec, recipe, 0) == alloc.layer(0)


def test_sensitivities_of_one_width_scale_every_choice(tiny_llama, tiny_recipe):
    """Measuring one width (what `kvsqueeze budget` does by default) gives exactly those entries and the
    same KL as the full measurement; the scales come from them alone, and both ':kl' budgets then predict every
    choice as its Fisher objective times its unit's scale."""
    import copy

    import numpy as np

    from conftest import random_ids

    from kvsqueeze.methods.budget import _objective, _options, measured_scales, sensitivity_key
    from kvsqueeze.calibrate.sensitivity import measure_sensitivity

    ids = random_ids(1, 40, seed=4)
    full = measure_sensitivity(tiny_llama, tiny_recipe, ids, fractions=(0.0, 0.01), progress=False)
    one = measure_sensitivity(tiny_llama, tiny_recipe, ids, fractions=(0.0, 0.01), bits=(3,), progress=False)
    assert (one["bits"], one["fractions"]) == ([3], [0.0, 0.01])
    assert sorted(one["kl"]) == sorted(k for k in full["kl"] if k.split(".")[2] == "3")
    for key, value in one["kl"].items():
        assert value == pytest.approx(full["kl"][key], rel=1e-6)
    recipe = copy.deepcopy(tiny_recipe)
    recipe.meta["sensitivity"] = {sensitivity_key(1): one}
    scales = measured_scales(recipe)
    for layer in range(2):
        for i, kv in enumerate("kv"):
            ratios = [one["kl"][f"{layer}.{kv}.3.{f:g}"] / _objective(recipe, layer, kv, c)
                      for f in (0.0, 0.01) for c in _options(recipe) if (c.bits, c.fraction) == (3, f)]
            assert scales[layer, i] == pytest.approx(float(np.exp(np.mean(np.log(ratios)))), rel=1e-9)
    alloc = allocate(recipe, 3.0, proxy="kl")  # 2- and 4-bit choices too, predicted from the 3-bit scale
    assert alloc.bits <= 3.0 + 1e-9 and {c.bits for c in alloc.keys + alloc.values} != {3}
    expected = sum(scales[layer, i] * _objective(recipe, layer, kv, c)
                   for layer in range(2) for i, (kv, c) in enumerate(zip("kv", alloc.layer(layer))))
    assert alloc.predicted == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="calibrated with"):
        measure_sensitivity(tiny_llama, tiny_recipe, ids, bits=(5,), progress=False)


def _with_sensitivities(recipe, scale):
    """A copy of `recipe` whose measured KL of every choice is `scale(layer, kv, choice)` times its Fisher objective."""
    import copy

    from kvsqueeze.methods.budget import _objective, _options, sensitivity_key, unit_key

    recipe = copy.deepcopy(recipe)
    layers = recipe.meta["model"]["fingerprint"]["layers"]
    kl = {unit_key(layer, kv, c): scale(layer, kv, c) * _objective(recipe, layer, kv, c)
          for layer in range(layers) for kv in "kv" for c in _options(recipe)}
    recipe.meta["sensitivity"] = {sensitivity_key(1): {"fractions": [0.0, 0.001, 0.01], "kl": kl}}
    return recipe


@pytest.mark.parametrize("avg", [2.5, 3.5, 4.5])
def test_measured_scales_weigh_whole_units_of_a_channel_budget(tiny_recipe, avg):
    """`nuq@B:kl:chan`: the Fisher errors rank the channels inside a unit, the measured sensitivities scale each
    unit. One scale for every unit changes nothing; a unit measured as costlier gets at least as many bits, and
    the others no more; each scale is the geometric mean of measured over predicted; a recipe without
    measurements is refused with the command that adds them."""
    import numpy as np

    from kvsqueeze.methods.budget import allocate_channels, measured_scales
    from kvsqueeze.recipe import RecipeError

    with pytest.raises(RecipeError, match="kvsqueeze budget"):
        allocate_channels(tiny_recipe, avg, proxy="kl")
    plain = allocate_channels(tiny_recipe, avg)
    same = _with_sensitivities(tiny_recipe, lambda layer, kv, c: 3e-2)
    np.testing.assert_allclose(measured_scales(same), 3e-2, rtol=1e-12)
    varied = _with_sensitivities(tiny_recipe, lambda layer, kv, c: 2.0 ** c.bits)  # 4, 8, 16 at 2, 3, 4 bits
    np.testing.assert_allclose(measured_scales(varied), 8.0, rtol=1e-12)
    got = allocate_channels(same, avg, proxy="kl")
    assert (got.keys, got.values) == (plain.keys, plain.values)
    heavy = _with_sensitivities(tiny_recipe, lambda layer, kv, c: 50.0 if (layer, kv) == (1, "k") else 1.0)
    scales = measured_scales(heavy)
    assert scales[1, 0] == pytest.approx(50.0) and np.allclose(np.delete(scales.reshape(-1), 2), 1.0)
    weighed = allocate_channels(heavy, avg, proxy="kl")
    assert weighed.bits <= avg + 1e-9
    fp = tiny_recipe.meta["model"]["fingerprint"]
    c = fp["kv_heads"] * fp["head_dim"]

    def held(alloc, units):
        return sum(unit_bits(kv, ch, 2048, c, 1) for kv, ch in units(alloc))

    heavy_unit = lambda a: [("k", a.keys[1])]  # noqa: E731
    others = lambda a: [("k", a.keys[0])] + [("v", ch) for ch in a.values]  # noqa: E731
    assert held(weighed, heavy_unit) >= held(plain, heavy_unit)
    assert held(weighed, others) <= held(plain, others)
    spec = parse_method(f"nuq@{avg:g}:kl:chan")
    assert (spec.name, spec.budget_proxy, spec.budget_unit) == (f"nuq@{avg:g}:kl:chan", "kl", "channel")
    assert parse_method(f"nuq@{avg:g}:chan:kl").name == spec.name
    assert layer_choices(spec, heavy, 1) == weighed.layer(1)


def test_sensitivity_runs_that_skip_the_unchanged_layers_equal_whole_forwards(tiny_llama, tiny_recipe):
    from conftest import random_ids

    from kvsqueeze.calibrate.sensitivity import measure_sensitivity

    ids = random_ids(1, 40, seed=2)
    fast = measure_sensitivity(tiny_llama, tiny_recipe, ids, fractions=(0.0,), progress=False)
    whole = measure_sensitivity(tiny_llama, tiny_recipe, ids, fractions=(0.0,), progress=False, skip_layers=False)
    assert fast["skipped_unchanged_layers"] and not whole["skipped_unchanged_layers"]
    assert fast["kl"].keys() == whole["kl"].keys() and len(fast["kl"]) == 2 * 2 * 3
    for key, value in whole["kl"].items():
        assert fast["kl"][key] == pytest.approx(value, rel=1e-4, abs=1e-9), key


# ---- a width per channel (nuq@AVG:chan) -------------------------------------------------------------------------
def _table_loss(recipe, alloc) -> float:
    """The summed per-channel errors of an allocation, read from the recipe's tables."""
    from kvsqueeze.methods.budget import CHANNEL_BITS

    total = 0.0
    for layer, (k, v) in enumerate(zip(alloc.keys, alloc.values)):
        for kv, c in (("k", k), ("v", v)):
            err = recipe.channel_errors(layer, kv, c.fraction)
            widths = c.widths if c.widths is not None else (c.bits,) * err.shape[0]
            total += float(sum(err[i, CHANNEL_BITS.index(w)] for i, w in enumerate(widths)))
    return total


def test_channel_errors_split_each_codebook_objective_by_channel(tiny_recipe):
    """Summed over channels, a width's per-channel errors are its codebook's Fisher-weighted objective (computed
    there on a histogram, so within its binning); fewer bits never cost a channel less."""
    from kvsqueeze.methods.budget import CHANNEL_BITS

    objective = tiny_recipe.meta["kmeans_objective"]
    for layer in (0, 1):
        for kv in ("k", "v"):
            for fraction, pct in ((0.0, "p0"), (0.01, "p1")):
                err = tiny_recipe.channel_errors(layer, kv, fraction).double()
                assert err.shape == (32, len(CHANNEL_BITS)) and (err >= 0).all()
                assert (err[:, :-1] >= err[:, 1:] * (1 - 1e-6)).all()  # wider codebooks fit every channel better
                for i, bits in enumerate(CHANNEL_BITS):
                    want = objective[f"layers.{layer}.codebook.{kv}.b{bits}.{pct}.vector.fs2"]["nuq"]
                    assert float(err[:, i].sum()) == pytest.approx(want, rel=0.05), (layer, kv, pct, bits)


@pytest.mark.parametrize("avg", [2.2, 2.6, 3.0, 3.5, 4.0])
def test_channel_budgets_fit_and_predict_no_more_loss_than_layer_budgets(tiny_recipe, avg):
    """A width per layer is one of the choices a width per channel has: at the same bits, the per-channel choice
    predicts at most the per-layer one's loss, and it fits its budget, every byte counted."""
    from kvsqueeze.methods.budget import CHANNEL_BITS, allocate_channels

    chan = allocate_channels(tiny_recipe, avg)
    # the budget spent, not left over, to within a step: on the tiny model (32 channels, 2 layers) one more code word
    # or one more bit for a whole unit is a quarter of a bit of the average
    assert chan.bits <= avg + 1e-9 and chan.bits >= avg - 0.25
    assert chan.predicted == pytest.approx(_table_loss(tiny_recipe, chan))
    assert all(c.widths is None or (set(c.widths) <= set(CHANNEL_BITS) and c.bits == max(c.widths))
               for c in chan.keys + chan.values)
    assert any(c.widths is not None for c in chan.keys + chan.values) or avg >= 4.0  # widths per channel below 4 bits
    if avg >= 3.0:  # the per-layer choice has nothing under 2 bits (2.78 stored on the tiny model)
        layer = allocate(tiny_recipe, avg)
        assert chan.predicted <= _table_loss(tiny_recipe, layer) * (1 + 1e-9)
    fp = tiny_recipe.meta["model"]["fingerprint"]
    c = fp["kv_heads"] * fp["head_dim"]
    spent = sum(unit_bits(kv, ch, 2048, c, 1) for k, v in zip(chan.keys, chan.values)
                for kv, ch in (("k", k), ("v", v))) + shared_bits([2048] * fp["layers"], c, 1, 0, 2048)
    assert spent / (2 * 2048 * c * fp["layers"]) == pytest.approx(chan.bits)


@pytest.mark.parametrize("plain", ["nuq2-1%", "nuq3-1%", "nuq4-1%", "nuq3"])
def test_channel_budgets_at_a_plain_methods_bits_afford_it_and_predict_no_more_loss(tiny_recipe, plain):
    """A layer may take one width for all its channels, stored as a plain method stores it (no width table): at the
    bits a plain nuq method stores, the per-channel budget can afford that method in every layer and predicts no
    more loss. Where nothing wider is left to buy (a recipe whose widths stop at 4 bits, as those calibrated before
    the 5- and 6-bit codebooks, at 4 bits), every layer keeps one width of 4 bits (with the outliers that pay), and
    its quantizers are the plain method's."""
    import copy
    import math

    from kvsqueeze.methods.budget import Allocation, allocate_channels
    from kvsqueeze.methods import build_quantizers

    spec = parse_method(plain)
    fp = tiny_recipe.meta["model"]["fingerprint"]
    c = fp["kv_heads"] * fp["head_dim"]
    choice = Choice(spec.k_bits, spec.outlier_fraction)
    avg = math.ceil(_avg_bits(tiny_recipe, spec) * 1e4) / 1e4
    everywhere = (choice,) * fp["layers"]
    plain_loss = _table_loss(tiny_recipe, Allocation(avg, 2048, everywhere, everywhere, 0.0, avg))
    narrow = copy.deepcopy(tiny_recipe)
    narrow.tensors = {k: v[:, :4] if ".chanerr." in k else v for k, v in narrow.tensors.items()}
    for recipe in (tiny_recipe, narrow):
        chan = allocate_channels(recipe, avg)
        assert chan.bits <= avg + 1e-9
        assert chan.predicted <= plain_loss * (1 + 1e-9)
    assert max(c.bits for c in chan.keys + chan.values) <= 4
    if spec.k_bits < 4:
        return
    assert all(ch.widths is None and ch.bits == 4 for ch in chan.keys + chan.values)
    x = torch.randn(50, c) * torch.linspace(0.2, 3.0, c)
    for layer in range(fp["layers"]):
        got = build_quantizers(parse_method(f"nuq@{avg:g}:chan"), narrow, layer, c, fp["head_dim"])
        for side, ch in ((0, chan.keys[layer]), (1, chan.values[layer])):
            same = parse_method("nuq4" + (f"-{100 * ch.fraction:g}%" if ch.fraction else ""))
            want = build_quantizers(same, tiny_recipe, layer, c, fp["head_dim"])[side]
            assert got[side].widths is None
            torch.testing.assert_close(got[side].fake(x)[0], want.fake(x)[0], atol=0, rtol=0)


def test_channel_budgets_round_trip_and_refuse_what_they_cannot_do(tiny_recipe):
    import copy

    from kvsqueeze.methods.budget import Allocation, allocate_channels

    alloc = recipe_allocation(tiny_recipe, 3.0, unit="channel")
    assert alloc == allocate_channels(tiny_recipe, 3.0)
    assert Allocation.from_dict(alloc.as_dict()) == alloc
    assert layer_choices(parse_method("nuq@3:chan"), tiny_recipe, 1) == alloc.layer(1)
    with pytest.raises(MethodError, match="below what this recipe can store"):
        allocate_channels(tiny_recipe, 1.0)
    old = copy.deepcopy(tiny_recipe)  # a recipe from before the per-channel tables
    old.tensors = {k: v for k, v in old.tensors.items() if ".chanerr." not in k}
    with pytest.raises(Exception, match="recalibrate"):
        allocate_channels(old, 3.0)


def test_channel_widths_quantize_each_channel_with_its_own_codebook(tiny_recipe):
    """A quantizer with a width per channel gives every channel exactly what the plain quantizer of that width
    (same ranges, same outliers) gives it, keys (per channel) and values (per token) alike."""
    from kvsqueeze.methods import build_quantizers

    spec = parse_method("nuq@3:chan")
    alloc = recipe_allocation(tiny_recipe, 3.0, unit="channel")
    x = torch.randn(50, 32) * torch.linspace(0.2, 3.0, 32)
    checked = 0
    for layer in (0, 1):
        kq, vq = build_quantizers(spec, tiny_recipe, layer, 32, 8)
        for q, choice, side in ((kq, alloc.keys[layer], 0), (vq, alloc.values[layer], 1)):
            if choice.widths is None:  # one width for the layer: a plain quantizer (the test above)
                continue
            checked += 1
            assert tuple(q.widths.tolist()) == choice.widths
            got, kept = q.fake(x)
            for w in set(choice.widths):
                plain = parse_method(f"nuq{max(w, 2)}" + (f"-{100 * choice.fraction:g}%" if choice.fraction else ""))
                pq = build_quantizers(plain, tiny_recipe, layer, 32, 8)[side]
                from kvsqueeze.methods.families import with_widths

                pq = with_widths(pq, (w,) * 32, tiny_recipe, layer, "kv"[side], 32)  # that width everywhere
                want, want_kept = pq.fake(x)
                sel = q.widths == w
                torch.testing.assert_close(got[:, sel], want[:, sel], atol=0, rtol=0)
                assert kept == want_kept  # the outliers do not depend on the widths
            assert ((got - x).abs() > 0).any()
    assert checked


def _mixed(recipe, avg: float):
    """A copy of `recipe` whose stored `nuq@{avg}:chan` choice gives layer 0's keys widths 1 to 6 over its channels
    and layer 1's values widths 2 to 5 (the tiny random model's channels are too alike for the budget to choose
    such a spread itself): what every path must store and read."""
    import copy
    import dataclasses

    from kvsqueeze.methods.budget import budget_key

    alloc = recipe_allocation(recipe, avg, unit="channel")
    c = len(alloc.keys[0].widths or ()) or recipe.meta["model"]["fingerprint"]["kv_heads"] * \
        recipe.meta["model"]["fingerprint"]["head_dim"]
    keys = (Choice(6, 0.01, tuple(1 + i % 6 for i in range(c))),) + alloc.keys[1:]
    values = alloc.values[:1] + (Choice(5, 0.0, tuple(2 + i % 4 for i in range(c))),)
    layers = len(keys)
    spent = sum(unit_bits(kv, ch, alloc.tokens, c, 1) for k, v in zip(keys, values) for kv, ch in (("k", k), ("v", v)))
    bits = (spent + shared_bits([alloc.tokens] * layers, c, 1, 0, alloc.tokens)) / (2 * alloc.tokens * c * layers)  # what they hold
    out = copy.deepcopy(recipe)
    out.meta.setdefault("budgets", {})[budget_key(avg, 1, unit="channel")] = dataclasses.replace(
        alloc, keys=keys, values=values, bits=bits).as_dict()
    return out


def test_channel_budgets_reach_the_simulated_path_the_compressed_cache_and_the_fused_kernels(tiny_llama, tiny_recipe):
    """The simulated path counts each layer's widths as the compressed cache holds them; the cache stores every
    channel in its own width and gives the simulated path's logits; fused decode through the numba and the
    Triton kernels generates what the dense path does. At 4 bits on average the tiny recipe's choice mixes
    layers of one width with channels of their own widths up to 5 bits (the kernels' 64-level tables)."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode
    from kvsqueeze.integrations.prefill import compressed
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    spec = parse_method("nuq@4:chan")
    tiny_recipe = _mixed(tiny_recipe, 4.0)
    alloc = recipe_allocation(tiny_recipe, 4.0, unit="channel")
    choices = alloc.keys + alloc.values
    assert any(c.widths is None for c in choices) and max(max(c.widths or (0,)) for c in choices) > 4
    ids = random_ids(1, 30, seed=4)
    with torch.no_grad():
        exact = tiny_llama(ids).logits
        with SimulatedQuantization(tiny_llama, spec, tiny_recipe) as sim:
            ref = tiny_llama(ids, cache=sim.new_cache(), use_cache=True).logits
            bits = sim.storage(30)
        with SimulatedQuantization(tiny_llama, parse_method("nuq2"), tiny_recipe) as sim2:
            two = tiny_llama(ids, cache=sim2.new_cache(), use_cache=True).logits
        cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, spec)
        got = torch.cat([tiny_llama(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(30)], 1)
        for i, layer in enumerate(cache.layers):
            for q, choice in ((layer.store.key_quantizer, alloc.keys[i]), (layer.store.value_quantizer, alloc.values[i])):
                assert (None if q.widths is None else tuple(q.widths.tolist())) == choice.widths
                assert q.bits == choice.bits
        cache2 = kvsqueeze.cache_for(tiny_llama, tiny_recipe, spec)
        with fused_decode(tiny_llama, cache2):
            fused = tiny_llama.generate(ids[:, :20], cache=cache2, max_new_tokens=5, min_new_tokens=5,
                                        do_sample=False, pad_token_id=0)
        dense = tiny_llama.generate(ids[:, :20], cache=kvsqueeze.cache_for(tiny_llama, tiny_recipe, spec),
                                    max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert not torch.equal(ref, exact)
    assert (ref - exact).abs().mean() < (two - exact).abs().mean()  # 4 bits on average beat 2 everywhere
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused, dense)
    assert bits == cache.memory_report().components
    assert compressed(spec)
    cache3 = kvsqueeze.cache_for(tiny_llama, tiny_recipe, spec)
    with torch.no_grad(), fused_decode(tiny_llama, cache3, "triton"):  # the GPU kernels, under the interpreter
        triton = tiny_llama.generate(ids[:, :20], cache=cache3, max_new_tokens=3, min_new_tokens=3,
                                     do_sample=False, pad_token_id=0)
    assert torch.equal(triton, dense[:, :23])


def test_channel_widths_the_kernels_cannot_read_and_broken_tables_are_refused(tiny_recipe):
    """A width past the kernels' 64-level tables or widths that do not fit the layer (too few, or one without its
    codebook), handed to a store or a page layout, and per-channel errors that are not finite all raise before
    any token is stored."""
    import copy
    import dataclasses

    from kvsqueeze.methods.budget import allocate_channels
    from kvsqueeze.cache.store import KVStore
    from kvsqueeze.paged.layout import PageLayout
    from kvsqueeze.methods import build_quantizers

    kq, vq = build_quantizers(parse_method("nuq@3:chan"), _mixed(tiny_recipe, 3.0), 0, 32, 8)
    wide = dataclasses.replace(kq, widths=torch.full((32,), 7))
    with pytest.raises(MethodError, match=r"widths \[7\] are not supported"):
        KVStore(wide, vq, 32, 1, head_dim=8)
    with pytest.raises(MethodError, match=r"widths \[7\] are not supported"):
        PageLayout(wide, vq, 32, 8, block_size=16, sinks=1)
    short = dataclasses.replace(kq, widths=kq.widths[:16])  # widths of a 16-channel layer
    orphan = dataclasses.replace(kq, codebooks={b: c for b, c in kq.codebooks.items() if b != int(kq.widths[0])})
    for bad, why in ((short, "16 channel widths for 32 channels"), (orphan, "a width without its codebook")):
        with pytest.raises(ValueError, match=f"KVStore: .*{why}"):
            KVStore(bad, vq, 32, 1, head_dim=8)
        with pytest.raises(ValueError, match=f"PageLayout: .*keys: .*{why}"):
            PageLayout(bad, vq, 32, 8, block_size=16, sinks=1)
    broken = copy.deepcopy(tiny_recipe)
    key = next(k for k in broken.tensors if ".chanerr." in k)
    broken.tensors[key] = broken.tensors[key].clone().fill_(float("nan"))
    with pytest.raises(Exception, match="NaN"):
        allocate_channels(broken, 3.0)


def test_measuring_kl_sensitivities_again_drops_only_the_choices_made_from_that_table(tiny_recipe):
    """A `:kl` budget stored (or computed in this process) from one sink count's table is forgotten when that
    table is measured again; the Fisher choices and another sink count's `:kl` choices stay."""
    import copy

    from kvsqueeze.methods.budget import _COMPUTED, drop_kl_budgets

    recipe = copy.deepcopy(tiny_recipe)
    recipe.meta["budgets"] = {k: {} for k in ("3.5", "3.5:chan", "3.5:kl", "3.5:kl:chan", "3.5:r32:kl:chan:ctx32k",
                                              "3.5:sink4:kl", "2.5:sink4:kl:chan")}
    _COMPUTED[(id(recipe), 3.5, 1, "kl", "channel", 0, 2048)] = (recipe, None)
    _COMPUTED[(id(recipe), 3.5, 1, "fisher", "channel", 0, 2048)] = (recipe, None)
    assert sorted(drop_kl_budgets(recipe, 1)) == ["3.5:kl", "3.5:kl:chan", "3.5:r32:kl:chan:ctx32k"]
    assert set(recipe.meta["budgets"]) == {"3.5", "3.5:chan", "3.5:sink4:kl", "2.5:sink4:kl:chan"}
    assert (id(recipe), 3.5, 1, "kl", "channel", 0, 2048) not in _COMPUTED
    assert _COMPUTED.pop((id(recipe), 3.5, 1, "fisher", "channel", 0, 2048))[0] is recipe
    assert sorted(drop_kl_budgets(recipe, 4)) == ["2.5:sink4:kl:chan", "3.5:sink4:kl"]


def test_fixed_key_slots_of_a_budget_are_at_most_what_each_layer_paid_for(tiny_recipe, monkeypatch):
    """A budget charges a layer's key outliers at their headroom over the nominal count; ':kslotsN' gives each
    layer at most N slots and no more than it paid for, so that no layer holds more bits than the budget's name
    (one N serves layers of 1% and of 0.1% alike: the default the vLLM backend serves). Layer 1 keeps 10% of
    the tiny model's 32 key channels exact (4 slots paid), layer 0 1% (1 slot)."""
    from kvsqueeze.methods import build_quantizers, family
    from kvsqueeze.methods.budget import KEY_OUTLIER_HEADROOM

    c = 32
    fractions = {0: 0.01, 1: 0.1}
    spec = parse_method("nuq@3.5:kslots1")
    monkeypatch.setattr(type(family(spec)), "choices",
                        lambda self, spec, recipe, layer: (Choice(3, fractions[layer]), Choice(3, 0.0)))
    monkeypatch.setattr(tiny_recipe, "codebook", lambda *a: torch.linspace(-1, 1, 8))
    monkeypatch.setattr(tiny_recipe, "channel_range", lambda *a: (-torch.ones(c), torch.ones(c)))
    paid = {layer: math.ceil(KEY_OUTLIER_HEADROOM * f * c) for layer, f in fractions.items()}
    assert paid == {0: 1, 1: 4}
    for n, want in ((1, {0: 1, 1: 1}), (4, {0: 1, 1: 4}), (6, {0: 1, 1: 4})):
        got = {layer: build_quantizers(parse_method(f"nuq@3.5:kslots{n}"), tiny_recipe, layer, c, 16)[0].slots
               for layer in fractions}
        assert got == want, n
