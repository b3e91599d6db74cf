"""Tests for kvsqueeze.recipe (the safetensors + JSON artifact) and what calibrate.fit puts in it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import CHANNELS, LAYERS, tiny_model
from kvsqueeze.numerics.datatypes import check_codebook
from kvsqueeze.integrations.fingerprint import check_recipe, model_fingerprint
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import (
    FORMAT_VERSION,
    META_FILE,
    TENSORS_FILE,
    Recipe,
    RecipeError,
    codebook_key,
    matrix_key,
    pct_tag,
    range_key,
)


@pytest.fixture
def recipe_copy(tiny_recipe_dir, tmp_path):
    """A private copy of the saved tiny recipe that a test may corrupt."""
    d = tmp_path / "recipe"
    shutil.copytree(tiny_recipe_dir, d)
    return d


def _rewrite_tensors(d, tensors):
    """Replace recipe.safetensors and fix up the checksum, as a careless tool would."""
    import hashlib

    from safetensors.torch import save_file

    save_file(tensors, str(d / TENSORS_FILE))
    meta = json.loads((d / META_FILE).read_text())
    meta["tensors_sha256"] = hashlib.sha256((d / TENSORS_FILE).read_bytes()).hexdigest()
    (d / META_FILE).write_text(json.dumps(meta))


# ---- round trip --------------------------------------------------------------------------------
def test_save_load_round_trip(tiny_recipe, tiny_recipe_dir):
    loaded = Recipe.load(tiny_recipe_dir)
    assert set(loaded.tensors) == set(tiny_recipe.tensors)
    for k, v in tiny_recipe.tensors.items():
        assert torch.equal(loaded.tensors[k], v.float()), k
    extra = {"format_version", "tensors_sha256"}
    assert {k: v for k, v in loaded.meta.items() if k not in extra} == tiny_recipe.meta
    assert loaded.meta["format_version"] == FORMAT_VERSION
    assert "format_version" not in tiny_recipe.meta, "save() must not mutate the in-memory recipe"


def test_saved_files_are_safetensors_and_json_not_pickle(tiny_recipe_dir):
    assert sorted(p.name for p in tiny_recipe_dir.iterdir()) == sorted([TENSORS_FILE, META_FILE])
    meta = json.loads((tiny_recipe_dir / META_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["model"]["id"] == "tiny-llama" and meta["text"] == "random"
    assert meta["settings"]["samples"] == 4 and meta["settings"]["seqlen"] == 128
    assert set(meta["timings_s"]) >= {"fisher", "fit"}
    assert meta["kmeans_objective"]
    header_len = int.from_bytes((tiny_recipe_dir / TENSORS_FILE).read_bytes()[:8], "little")
    header = json.loads((tiny_recipe_dir / TENSORS_FILE).read_bytes()[8 : 8 + header_len])
    assert header["__metadata__"]["format_version"] == str(FORMAT_VERSION)


def test_saved_recipe_drives_the_same_quantization(tiny_llama, tiny_recipe, tiny_recipe_dir):
    from conftest import random_ids

    ids = random_ids(1, 48, seed=5)
    spec = parse_method("nuq3-1%")
    outs = []
    for r in (tiny_recipe, Recipe.load(tiny_recipe_dir)):
        with torch.no_grad(), SimulatedQuantization(tiny_llama, spec, r) as sim:
            outs.append(tiny_llama(input_ids=ids, cache=sim.new_cache()).logits)
    assert torch.equal(outs[0], outs[1])


# ---- contents ----------------------------------------------------------------------------------
def test_codebooks_sorted_inside_unit_interval(tiny_recipe):
    keys = [k for k in tiny_recipe.tensors if ".codebook." in k]
    # 2 layers x (K, V) x 3 bit widths x (p0 vector + 2 fractions x (vector, matrix)) x fits, and the 1-, 5- and
    # 6-bit codebooks of per-channel budgets (Fisher*s^2, per vector, every fraction)
    assert len(keys) == LAYERS * 2 * (3 * (3 + 2 * 3 + 2 * 1) + 3 * 3)
    for k in keys:
        cb = tiny_recipe.tensors[k]
        bits = int(k.split(".b")[1].split(".")[0])
        assert cb.shape == (2**bits,), k
        assert torch.all(cb.diff() >= 0), k
        assert cb.min() >= -1 - 1e-6 and cb.max() <= 1 + 1e-6, k
        check_codebook(cb, bits)


def test_fit_variants_give_different_codebooks(tiny_recipe):
    """fs2 weights by Fisher * s^2, fisher by Fisher alone, unw by 1: with scales that differ between
    channels (keys) and tokens (values) the three fits must not coincide."""
    for layer in range(LAYERS):
        for kv in "kv":
            cbs = {fit: tiny_recipe.codebook(layer, kv, 3, 0.0, "vector", fit) for fit in ("fs2", "fisher", "unw")}
            assert not torch.allclose(cbs["fs2"], cbs["fisher"], atol=1e-4), (layer, kv)
            assert not torch.allclose(cbs["fisher"], cbs["unw"], atol=1e-4), (layer, kv)


def test_kmeans_objectives_nuq_never_worse_than_fixed_levels(tiny_recipe_dir):
    meta = json.loads((tiny_recipe_dir / META_FILE).read_text())
    objs = meta["kmeans_objective"]
    # fs2 only: p0 vector, 2 fractions x (vector, matrix); and 1, 5 and 6 bits per vector (per-channel budgets)
    assert len(objs) == LAYERS * 2 * (3 * 5 + 3 * 3)
    for k, o in objs.items():
        assert o["nuq"] >= 0
        assert o["nuq"] <= o["uniform"] * (1 + 1e-9) + 1e-300, k
        assert ".b1." in k or o["nuq"] <= o["nf"] * (1 + 1e-9) + 1e-300, k  # NormalFloat needs 2 bits
    # the optimum improves strictly with more levels
    for layer in range(LAYERS):
        for kv in "kv":
            per_bits = [objs[codebook_key(layer, kv, b, 0.0, "vector", "fs2")]["nuq"] for b in (1, 2, 3, 4)]
            assert per_bits[0] > per_bits[1] > per_bits[2] > per_bits[3]


def test_ranges_match_calibration_data(tiny_recipe, tiny_acts):
    for layer in range(LAYERS):
        k = tiny_acts.keys[layer].float()
        v = tiny_acts.values[layer].float()
        lo, hi = tiny_recipe.channel_range(layer, "k_pre", 0.0)
        assert torch.equal(lo, k.amin(0)) and torch.equal(hi, k.amax(0))
        lo, hi = tiny_recipe.channel_range(layer, "v", 0.0)
        assert torch.equal(lo, v.amin(0)) and torch.equal(hi, v.amax(0))
        for t in ("k_pre", "k_post", "v"):
            lo0, hi0 = tiny_recipe.channel_range(layer, t, 0.0)
            assert lo0.shape == (CHANNELS,)
            for p in (0.001, 0.01):
                lo, hi = tiny_recipe.channel_range(layer, t, p)
                assert torch.all(lo0 <= lo) and torch.all(lo <= hi) and torch.all(hi <= hi0), (t, p)
                m_lo, m_hi = tiny_recipe.matrix_thresholds(layer, t, p)
                assert m_lo.ndim == 0 and m_lo < m_hi


def test_fingerprint_and_check_model(tiny_llama, tiny_recipe):
    fp = model_fingerprint(tiny_llama)
    assert fp["kv_heads"] == 2 and fp["head_dim"] == 16 and fp["layers"] == LAYERS
    assert tiny_recipe.meta["model"]["fingerprint"] == fp
    check_recipe(tiny_recipe, tiny_llama)  # no error


def test_recipe_of_another_seed_is_rejected(tiny_recipe):
    other = tiny_model("llama", seed=99)
    with pytest.raises(RecipeError, match=r"calibrated on model 'tiny-llama'.*k_proj_sha256.*kvsqueeze calibrate"):
        check_recipe(tiny_recipe, other)
    with pytest.raises(RecipeError, match="k_proj_sha256"):
        SimulatedQuantization(other, parse_method("nuq3-1%"), tiny_recipe)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recipe_serves_the_same_model_at_another_precision(tiny_recipe, tiny_recipe_dir, dtype):
    model = tiny_model("llama", seed=0).to(dtype)  # calibrated in fp32, served in half precision
    assert model_fingerprint(model)["k_proj_sha256"] != tiny_recipe.meta["model"]["fingerprint"]["k_proj_sha256"]
    check_recipe(tiny_recipe, model)  # no error
    check_recipe(Recipe.load(tiny_recipe_dir), model)  # the probes survive the JSON round trip
    SimulatedQuantization(model, parse_method("nuq3-1%"), tiny_recipe)
    with torch.no_grad():  # a change of the weights far smaller than another model's is still refused
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.05)
    with pytest.raises(RecipeError, match="k_proj_sha256.*differ by more than a change of precision"):
        check_recipe(tiny_recipe, model)


def test_recipe_without_probes_needs_the_exact_weights(tiny_recipe):
    old = Recipe(meta=json.loads(json.dumps(tiny_recipe.meta)), tensors=tiny_recipe.tensors)
    del old.meta["model"]["fingerprint"]["k_proj_probe"]
    check_recipe(old, tiny_model("llama", seed=0))  # no error
    with pytest.raises(RecipeError, match="k_proj_sha256"):
        check_recipe(old, tiny_model("llama", seed=0).to(torch.bfloat16))
    old.meta["model"]["fingerprint"]["k_proj_probe"] = ["x"] * 128  # a hand-edited file: an error, not a crash
    with pytest.raises(RecipeError, match="k_proj_sha256"):
        check_recipe(old, tiny_model("llama", seed=0).to(torch.bfloat16))


@pytest.mark.parametrize("overrides,field", [
    (dict(num_key_value_heads=4), "kv_heads"),
    (dict(num_hidden_layers=3), "layers"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), "hidden_size"),
])
def test_recipe_of_another_shape_is_rejected(tiny_recipe, overrides, field):
    other = tiny_model("llama", seed=0, **overrides)
    with pytest.raises(RecipeError, match=rf"{field}: recipe \S+ vs model \S+"):
        check_recipe(tiny_recipe, other)


def test_missing_calibration_setting_is_named(tiny_llama, tiny_recipe):
    with pytest.raises(RecipeError, match=r"p0\.5.*fractions=\[0\.0, 0\.001, 0\.01\].*recalibrate"):
        SimulatedQuantization(tiny_llama, parse_method("nuq3-0.5%"), tiny_recipe)


def test_wrong_channel_count_is_rejected(tiny_recipe):
    from kvsqueeze.methods import build_quantizers

    with pytest.raises(RecipeError, match=r"has 32 k_pre channels, the model has 64"):
        build_quantizers(parse_method("nuq3"), tiny_recipe, 0, 64)


# ---- corrupted or missing files ----------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(RecipeError, match=r"is not a recipe.*kvsqueeze calibrate"):
        Recipe.load(tmp_path / "nope")


def test_missing_tensor_file(recipe_copy):
    (recipe_copy / TENSORS_FILE).unlink()
    with pytest.raises(RecipeError, match="is not a recipe"):
        Recipe.load(recipe_copy)


@pytest.mark.parametrize("where", [0.02, 0.5, 0.99])
def test_flipped_bytes_in_tensors(recipe_copy, where):
    p = recipe_copy / TENSORS_FILE
    raw = bytearray(p.read_bytes())
    i = int(where * (len(raw) - 1))
    raw[i] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(RecipeError, match="corrupted"):
        Recipe.load(recipe_copy)


@pytest.mark.parametrize("keep", [0, 7, 100, -10])
def test_truncated_tensors(recipe_copy, keep):
    p = recipe_copy / TENSORS_FILE
    raw = p.read_bytes()
    p.write_bytes(raw[:keep] if keep >= 0 else raw[:keep])
    with pytest.raises(RecipeError):
        Recipe.load(recipe_copy)


def test_garbage_tensor_file_with_a_matching_checksum(recipe_copy):
    import hashlib

    p = recipe_copy / TENSORS_FILE
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + b"\x00" * 32)
    meta = json.loads((recipe_copy / META_FILE).read_text())
    meta["tensors_sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    (recipe_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match="cannot be read"):
        Recipe.load(recipe_copy)


def test_nan_tensor_is_rejected(recipe_copy, tiny_recipe):
    tensors = {k: v.clone() for k, v in tiny_recipe.tensors.items()}
    key = codebook_key(0, "k", 3, 0.01, "vector", "fs2")
    tensors[key][2] = float("nan")
    _rewrite_tensors(recipe_copy, tensors)
    with pytest.raises(RecipeError, match=rf"{key}.*NaN"):
        Recipe.load(recipe_copy)


@pytest.mark.parametrize("text", ['{"format_version": 1, ', "", "\xff\xfe garbage", "{]"])
def test_corrupted_json(recipe_copy, text):
    (recipe_copy / META_FILE).write_text(text, encoding="latin-1")
    with pytest.raises(RecipeError, match="corrupted"):
        Recipe.load(recipe_copy)


@pytest.mark.parametrize("text", ["[]", "null"])
def test_json_that_is_not_an_object(recipe_copy, text):
    """Valid JSON that is not an object currently escapes as AttributeError ('list' has no 'get')."""
    (recipe_copy / META_FILE).write_text(text)
    with pytest.raises(RecipeError):
        Recipe.load(recipe_copy)


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_wrong_format_version(recipe_copy, version):
    meta = json.loads((recipe_copy / META_FILE).read_text())
    if version is None:
        del meta["format_version"]
    else:
        meta["format_version"] = version
    (recipe_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match=r"format version .* reads version 1"):
        Recipe.load(recipe_copy)


def test_key_helpers():
    assert pct_tag(0.01) == "p1" and pct_tag(0.001) == "p0.1" and pct_tag(0.0) == "p0"
    assert range_key(3, "k_pre", 0.01) == "layers.3.k_pre.range.p1"
    assert matrix_key(0, "v", 0.001) == "layers.0.v.matrix.p0.1"
    assert codebook_key(1, "v", 2, 0.0, "vector", "unw") == "layers.1.codebook.v.b2.p0.vector.unw"


def test_recipe_error_is_a_value_error():
    assert issubclass(RecipeError, ValueError)
