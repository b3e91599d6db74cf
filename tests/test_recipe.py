"""Tests for kvsqueeze.recipe (the safetensors + JSON artifact) and what calibrate.fit puts in it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import CALIB_SAMPLES, CALIB_SEQLEN, CHANNELS, LAYERS, tiny_model
from kvsqueeze.numerics.datatypes import check_codebook
from kvsqueeze.integrations.fingerprint import check_recipe, model_fingerprint
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import (
    FORMAT_VERSION,
    meta_digest,
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


def _reseal(d, meta=None):
    """Recompute both checksums of the recipe in `d` (with `meta` as its JSON), as a tool that edits recipes
    would: what is left to catch an edit is `Recipe.check`."""
    import hashlib

    meta = json.loads((d / META_FILE).read_text()) if meta is None else meta
    meta["tensors_sha256"] = hashlib.sha256((d / TENSORS_FILE).read_bytes()).hexdigest()
    meta["meta_sha256"] = meta_digest(meta)
    (d / META_FILE).write_text(json.dumps(meta))


def _rewrite_tensors(d, tensors):
    """Replace recipe.safetensors and fix up the checksums, as a careless tool would."""
    from safetensors.torch import save_file

    save_file(tensors, str(d / TENSORS_FILE))
    _reseal(d)


# ---- round trip --------------------------------------------------------------------------------
def test_save_load_round_trip(tiny_recipe, tiny_recipe_dir):
    loaded = Recipe.load(tiny_recipe_dir)
    assert set(loaded.tensors) == set(tiny_recipe.tensors)
    for k, v in tiny_recipe.tensors.items():
        assert torch.equal(loaded.tensors[k], v.float()), k
    extra = {"format_version", "tensors_sha256", "meta_sha256"}
    assert {k: v for k, v in loaded.meta.items() if k not in extra} == tiny_recipe.meta
    assert loaded.meta["format_version"] == FORMAT_VERSION
    assert "format_version" not in tiny_recipe.meta, "save() must not mutate the in-memory recipe"


def test_saved_files_are_safetensors_and_json_not_pickle(tiny_recipe_dir):
    assert sorted(p.name for p in tiny_recipe_dir.iterdir() if not p.name.startswith(".")) == sorted(
        [TENSORS_FILE, META_FILE])
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


def test_a_default_calibration_fits_what_users_read_and_names_the_flag_for_the_rest(tiny_llama, tiny_acts):
    """Without --ablation only KVQuant's own objective per vector is fitted; a method that reads the others is
    refused, before any work, with the flag that fits them."""
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.methods import build_quantizers, parse_method

    r = fit_recipe(tiny_llama, tiny_acts, CalibrationConfig(samples=CALIB_SAMPLES, seqlen=CALIB_SEQLEN),
                   "tiny-llama", "random", progress=False)
    books = [k for k in r.tensors if ".codebook." in k]
    assert books and all(k.endswith(".vector.fs2") for k in books)
    assert not any(".matrix." in k for k in r.tensors)
    build_quantizers(parse_method("nuq3-1%"), r, 0, CHANNELS)
    for name in ("nuq3:fisher", "nuq3:unw", "nuq3-1%:pm"):
        with pytest.raises(RecipeError, match="--ablation"):
            build_quantizers(parse_method(name), r, 0, CHANNELS)


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
    with pytest.raises(RecipeError, match=r"calibrated on model 'tiny-llama'.*layer\(s\) 0, 1.*kvsqueeze calibrate"):
        check_recipe(tiny_recipe, other)
    with pytest.raises(RecipeError, match="layers_sha256"):
        SimulatedQuantization(other, parse_method("nuq3-1%"), tiny_recipe)


def test_a_model_whose_last_layer_differs_is_refused(tiny_recipe):
    """Every layer's keys are in the fingerprint, not only the first layer's."""
    model = tiny_model("llama", seed=0)
    check_recipe(tiny_recipe, model)
    with torch.no_grad():
        model.model.layers[-1].self_attn.k_proj.weight.mul_(1.05)
    with pytest.raises(RecipeError, match=rf"layer\(s\) {LAYERS - 1} differ"):
        check_recipe(tiny_recipe, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recipe_serves_the_same_model_at_another_precision(tiny_recipe, tiny_recipe_dir, dtype):
    model = tiny_model("llama", seed=0).to(dtype)  # calibrated in fp32, served in half precision
    assert model_fingerprint(model)["layers_sha256"] != tiny_recipe.meta["model"]["fingerprint"]["layers_sha256"]
    check_recipe(tiny_recipe, model)  # no error
    check_recipe(Recipe.load(tiny_recipe_dir), model)  # the probes survive the JSON round trip
    SimulatedQuantization(model, parse_method("nuq3-1%"), tiny_recipe)
    with torch.no_grad():  # a change of the weights far smaller than another model's is still refused
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.05)
    with pytest.raises(RecipeError, match="layer\\(s\\) 0 differ by more than a change of precision"):
        check_recipe(tiny_recipe, model)


def test_a_fine_tune_that_left_the_key_projections_alone_is_refused(tiny_recipe, tiny_recipe_dir):
    """A fine-tune of the query projection (LoRA's usual targets leave the keys' own weights alone) changes the
    hidden states every later layer's keys and values come from: the recipe is refused naming the tensor, after a
    JSON round trip too; the same model in bf16 is still served. A recipe from before every tensor was probed
    cannot tell."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.01)
    for recipe in (tiny_recipe, Recipe.load(tiny_recipe_dir)):
        with pytest.raises(RecipeError, match="model.layers.0.self_attn.q_proj.weight differ"):
            check_recipe(recipe, model)
    check_recipe(tiny_recipe, tiny_model("llama", seed=0).to(torch.bfloat16))
    old = Recipe(meta=json.loads(json.dumps(tiny_recipe.meta)), tensors=tiny_recipe.tensors)
    del old.meta["model"]["fingerprint"]["weights_probe"]
    check_recipe(old, model)


def test_recipe_with_broken_probes_needs_the_exact_weights(tiny_recipe):
    old = Recipe(meta=json.loads(json.dumps(tiny_recipe.meta)), tensors=tiny_recipe.tensors)
    old.meta["model"]["fingerprint"]["layers_probe"] = [["x"] * 16] * LAYERS  # an edited file: an error, no crash
    check_recipe(old, tiny_model("llama", seed=0))  # the hashes still match
    with pytest.raises(RecipeError, match="layers_sha256"):
        check_recipe(old, tiny_model("llama", seed=0).to(torch.bfloat16))


def test_nan_weights_are_named_as_such(tiny_recipe):
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(RecipeError, match="layer 1's key projection holds NaN/Inf weights"):
        check_recipe(tiny_recipe, model)


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
    _reseal(recipe_copy)
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


@pytest.mark.parametrize("version", [None, 0, 1, 3, "2"])
def test_wrong_format_version(recipe_copy, version):
    meta = json.loads((recipe_copy / META_FILE).read_text())
    if version is None:
        del meta["format_version"]
    else:
        meta["format_version"] = version
    (recipe_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match=r"format version .* reads version 2"):
        Recipe.load(recipe_copy)


def test_key_helpers():
    assert pct_tag(0.01) == "p1" and pct_tag(0.001) == "p0.1" and pct_tag(0.0) == "p0"
    assert range_key(3, "k_pre", 0.01) == "layers.3.k_pre.range.p1"
    assert matrix_key(0, "v", 0.001) == "layers.0.v.matrix.p0.1"
    assert codebook_key(1, "v", 2, 0.0, "vector", "unw") == "layers.1.codebook.v.b2.p0.vector.unw"


def test_recipe_error_is_a_value_error():
    assert issubclass(RecipeError, ValueError)


# ---- hostile recipes: every field checked before use ----------------------------------------------------------
def _edit_json(d, edit):
    meta = json.loads((d / META_FILE).read_text())
    edit(meta)
    _reseal(d, meta)


def _edit_tensor(d, key, edit):
    from safetensors.torch import load_file

    tensors = load_file(str(d / TENSORS_FILE))
    tensors[key] = edit(tensors[key].clone()).contiguous()
    _rewrite_tensors(d, tensors)


@pytest.mark.parametrize("key, edit, field", [
    (range_key(0, "k_pre", 0.01), lambda t: t.flip(0), "lo > hi"),  # the range swapped
    (range_key(1, "v", 0.0), torch.zeros_like, "empty range"),
    (codebook_key(0, "k", 3, 0.01, "vector", "fs2"), lambda t: t.fill_(0.25), "rise strictly"),
    (codebook_key(0, "v", 2, 0.0, "vector", "fs2"), lambda t: t.flip(0), "rise strictly"),
    (codebook_key(0, "v", 2, 0.0, "vector", "fs2"), lambda t: t * 3, "within \\[-1, 1\\]"),
    (codebook_key(1, "k", 4, 0.0, "vector", "fs2"), lambda t: t[:8], r"not \(16,\) levels"),
    (matrix_key(0, "v", 0.01), lambda t: t.flip(0), "lo < hi"),
    (range_key(0, "v", 0.01), lambda t: t * 3, "is not inside"),  # wider than the range of fewer outliers
    (codebook_key(0, "k", 3, 0.01, "vector", "fs2"), lambda t: t.half(), "dtype torch.float16"),
    (range_key(0, "k_post", 0.0), lambda t: t[:, :-1], "not \\(2, 32\\)"),
])
def test_tampered_tensors_are_named_even_with_fresh_checksums(recipe_copy, key, edit, field):
    _edit_tensor(recipe_copy, key, edit)
    with pytest.raises(RecipeError, match=rf"{re_escape(key)}.*{field}"):
        Recipe.load(recipe_copy)


def test_a_tensor_a_recipe_does_not_hold_is_named(recipe_copy, tiny_recipe):
    from safetensors.torch import load_file

    tensors = load_file(str(recipe_copy / TENSORS_FILE))
    tensors[f"layers.{LAYERS}.v.range.p0"] = tensors[range_key(0, "v", 0.0)].clone()
    _rewrite_tensors(recipe_copy, tensors)
    with pytest.raises(RecipeError, match=f"layers.{LAYERS}.v.range.p0.*past the model"):
        Recipe.load(recipe_copy)


def _budget(meta):
    fp = meta["model"]["fingerprint"]
    row = [3, 0.01]
    return {"avg_bits": 3.0, "tokens": 2048, "predicted": 0.1, "bits": 2.9, "keys": [row] * fp["layers"],
            "values": [row] * fp["layers"], "storage": 3}


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.update(model=[]), "model is list"),
    (lambda m: m["model"].update(fingerprint=None), "model.fingerprint is NoneType"),
    (lambda m: m["model"]["fingerprint"].update(layers=-1), r"model.fingerprint.layers is -1"),
    (lambda m: m["model"]["fingerprint"].update(layers_sha256=["0" * 16]), "layers_sha256 covers 1 layers"),
    (lambda m: m["settings"].update(fractions=[0.0, -0.01]), r"settings.fractions\[1\] is -0.01"),
    (lambda m: m["settings"].update(sinks="1"), "settings.sinks is '1'"),
    (lambda m: m["settings"].update(bits=[]), "settings.bits is empty"),
    (lambda m: m.update(budgets={"3": {**_budget(m), "keys": _budget(m)["keys"][:1]}}), r"budgets.3.keys has 1 layers"),
    (lambda m: m.update(budgets={"3": {**_budget(m), "keys": [[7, 0.01]] * LAYERS}}), r"budgets.3.keys\[0\]\[0\] \(bits\) is 7"),
    (lambda m: m.update(budgets={"3": {**_budget(m), "values": [[3, 0.01, [3] * 5]] * LAYERS}}), "has 5 channels"),
    (lambda m: m.update(budgets={"3": {**_budget(m), "avg_bits": float("nan")}}), None),  # NaN is not JSON
])
def test_tampered_json_fields_are_named_even_with_fresh_checksums(recipe_copy, edit, field):
    try:
        _edit_json(recipe_copy, edit)
    except ValueError:  # a NaN in the JSON: the reseal itself refuses to write it as strict JSON; write it raw
        meta = json.loads((recipe_copy / META_FILE).read_text())
        edit(meta)
        (recipe_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match=field or "corrupted|checksum"):
        Recipe.load(recipe_copy)


def test_an_edit_of_the_json_alone_breaks_its_checksum(recipe_copy):
    """A budget choice edited by hand (bits 3 -> 4) is caught by the checksum of the JSON, which covers it."""
    meta = json.loads((recipe_copy / META_FILE).read_text())
    meta["budgets"] = {"3": _budget(meta)}
    _reseal(recipe_copy, meta)
    assert Recipe.load(recipe_copy).meta["budgets"]["3"]["keys"][0] == [3, 0.01]
    meta["budgets"]["3"]["keys"][0] = [4, 0.01]
    (recipe_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match="its own checksum"):
        Recipe.load(recipe_copy)


def _save_many(args):
    src, d, tag, rounds = args
    recipe = Recipe.load(src)
    recipe.meta["text"] = tag
    key = codebook_key(0, "v", 2, 0.0, "vector", "fs2")
    recipe.tensors[key] = recipe.tensors[key] * (0.5 if tag == "b" else 1.0)  # another valid codebook
    for _ in range(rounds):
        recipe.save(d)


def test_two_processes_saving_one_recipe_leave_one_whole_recipe(recipe_copy, tiny_recipe):
    """Two writers of one directory at once: every load, during and after, gives one of the two recipes whole
    (its JSON with its own tensors), or a clear error, never a mix."""
    import multiprocessing

    key = codebook_key(0, "v", 2, 0.0, "vector", "fs2")
    base = tiny_recipe.tensors[key].float()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        src = recipe_copy.parent / "pristine"
        shutil.copytree(recipe_copy, src)
        pending = pool.map_async(_save_many, [(src, recipe_copy, "a", 8), (src, recipe_copy, "b", 8)])
        loads = 0
        while not pending.ready() or loads == 0:
            r = Recipe.load(recipe_copy)
            scale = 0.5 if r.meta["text"] == "b" else 1.0
            assert torch.equal(r.tensors[key], base * scale), "a JSON with the other writer's tensors"
            loads += 1
        pending.get()
    r = Recipe.load(recipe_copy)
    assert torch.equal(r.tensors[key], base * (0.5 if r.meta["text"] == "b" else 1.0))
    leftovers = [p.name for p in recipe_copy.iterdir() if p.name.startswith((f".{META_FILE}.", f".{TENSORS_FILE}."))]
    assert not leftovers, leftovers  # no temporary file is left behind


def test_a_second_calibration_to_the_same_directory_is_refused_at_once(tmp_path):
    from kvsqueeze.recipe import RUN_LOCK_FILE, writing

    with writing(tmp_path, lock=RUN_LOCK_FILE, wait=False):
        import subprocess
        import sys

        code = ("from kvsqueeze.recipe import RUN_LOCK_FILE, writing\n"
                f"with writing({str(tmp_path)!r}, lock=RUN_LOCK_FILE, wait=False): pass\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "another kvsqueeze process is writing a recipe to" in out.stderr


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def _format_1(d, model):
    """Rewrite the recipe in `d` as format 1 wrote it: one weight hash and 128 probes of the first layer's keys,
    no checksum of the JSON."""
    import hashlib

    from kvsqueeze.integrations.parts import attention_modules, key_weight

    meta = json.loads((d / META_FILE).read_text())
    flat = key_weight(attention_modules(model)[0], CHANNELS).detach().float().contiguous().view(-1)
    fp = meta["model"]["fingerprint"]
    del fp["layers_sha256"], fp["layers_probe"], meta["meta_sha256"]
    fp["k_proj_sha256"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    fp["k_proj_probe"] = flat[torch.linspace(0, flat.numel() - 1, 128).round().long()].tolist()
    meta["format_version"] = 1
    (d / META_FILE).write_text(json.dumps(meta))


def test_a_format_1_recipe_is_upgraded_against_its_model_only(recipe_copy, tiny_model_dir, tiny_llama, tmp_path,
                                                              capsys):
    from kvsqueeze.cli import main

    _format_1(recipe_copy, tiny_llama)
    with pytest.raises(RecipeError, match="format version 1.*upgrade-recipe"):
        Recipe.load(recipe_copy)
    other = tiny_model("llama", seed=99)
    other_dir = tmp_path / "other-model"
    other.save_pretrained(other_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / f).exists():
            shutil.copy(tiny_model_dir / f, other_dir / f)
    assert main(["upgrade-recipe", "--model", str(other_dir), "--recipe", str(recipe_copy)]) == 2
    assert "calibrated on another model" in capsys.readouterr().err
    assert main(["upgrade-recipe", "--model", str(tiny_model_dir), "--recipe", str(recipe_copy)]) == 0
    upgraded = Recipe.load(recipe_copy)
    check_recipe(upgraded, tiny_llama)
    assert upgraded.meta["format_version"] == FORMAT_VERSION


def test_a_tensor_past_2_24_elements_is_probed_within_its_bounds():
    """In float32 the last probe position of a tensor past 2**24 elements (here 2**24 + 3, odd, rounds up to
    2**24 + 4) lies past its end: both probes keep every position inside the tensor."""
    from kvsqueeze.recipe import key_digest, tensor_probe

    big = torch.arange(2**24 + 4, dtype=torch.float32)
    probe = tensor_probe(big)
    assert len(probe) == 16 and probe[0] == 0.0 and probe[-1] == float(big[-1])
    _, keys = key_digest(0, big.view(1, -1))
    assert len(keys) == 16 and keys[0] == 0.0 and keys[-1] == float(big[-1])


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_probes_do_not_depend_on_torchs_default_dtype(default):
    """vLLM streams the weights with its model dtype as torch's default: the probes must be taken at the same
    positions as under float32 (in bf16 they rounded past the end, in fp16 beyond 65,504 they overflowed)."""
    from kvsqueeze.recipe import key_digest, tensor_probe

    weight = torch.randn(128, 896, generator=torch.Generator().manual_seed(0))
    want = key_digest(0, weight), tensor_probe(weight)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = key_digest(0, weight), tensor_probe(weight)
    finally:
        torch.set_default_dtype(before)
    assert got == want


def test_a_model_is_fingerprinted_once_per_state_of_its_weights(tiny_llama, monkeypatch):
    """The fingerprint is taken once for the same weights (every cache checks its recipe against it), and taken
    again once any weight changes in place; what it returns may be changed by its caller."""
    import kvsqueeze.integrations.fingerprint as F

    taken = []
    real = F._fingerprint
    monkeypatch.setattr(F, "_fingerprint", lambda m: taken.append(1) or real(m))
    F._TAKEN.pop(tiny_llama, None)
    first = F.model_fingerprint(tiny_llama)
    first["layers_sha256"][0] = "changed by a caller"
    again = F.model_fingerprint(tiny_llama)
    assert len(taken) == 1 and again["layers_sha256"][0] != "changed by a caller"
    layer = tiny_llama.model.layers[0].self_attn.k_proj.weight
    saved = layer.detach().clone()
    with torch.no_grad():
        layer.mul_(1.01)
    try:
        moved = F.model_fingerprint(tiny_llama)
        assert len(taken) == 2 and moved["layers_sha256"][0] != again["layers_sha256"][0]
    finally:
        with torch.no_grad():
            layer.copy_(saved)  # the shared model exactly as it was
    assert F.model_fingerprint(tiny_llama) == again and len(taken) == 3


def test_a_model_built_under_inference_mode_is_fingerprinted():
    """Parameters made under torch.inference_mode keep no version counter: the fingerprint is then taken without
    its memo, not refused."""
    from conftest import tiny_model
    from kvsqueeze.integrations.fingerprint import model_fingerprint

    with torch.inference_mode():
        model = tiny_model("llama", seed=3)
    assert model_fingerprint(model) == model_fingerprint(model)


# ---- what a recipe holds stays loadable ---------------------------------------------------------------
def test_a_recipe_under_other_rope_settings_is_refused_and_one_from_before_them_is_not(tiny_recipe):
    """Post-RoPE ranges and every statistic after the first attention were measured under the model's RoPE: the
    same weights with another theta or scaling are another model to the recipe. A recipe written before the
    fingerprint named RoPE is not held to it."""
    import copy

    model = tiny_model("llama", seed=0)
    check_recipe(tiny_recipe, model)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 500000.0}
    with pytest.raises(RecipeError, match=r"rope: recipe .*10000.* vs model .*500000"):
        check_recipe(tiny_recipe, model)
    older = Recipe(meta=copy.deepcopy(tiny_recipe.meta), tensors=tiny_recipe.tensors)
    del older.meta["model"]["fingerprint"]["rope"]
    check_recipe(older, model)  # no error


def test_save_refuses_what_load_would_refuse(recipe_copy):
    """A recipe `load` would refuse (here a negative sensitivity) is not written over a good one."""
    recipe = Recipe.load(recipe_copy)
    before = (recipe_copy / META_FILE).read_bytes()
    recipe.meta["sensitivity"] = {"sink1": {"windows": 1, "seqlen": 48, "sinks": 1, "bits": [3],
                                            "fractions": [0.0], "kl": {"0.k.3.0": -1e-8}}}
    with pytest.raises(RecipeError, match="sensitivity"):
        recipe.save(recipe_copy)
    assert (recipe_copy / META_FILE).read_bytes() == before
    Recipe.load(recipe_copy)


def test_a_save_stopped_between_its_renames_is_finished_by_the_next_load(recipe_copy, monkeypatch):
    """Both files are staged whole before either is renamed: stopped after the tensors' rename, the staged JSON
    is renamed into place by `load`, which then reads the new pair; stopped before it, the old pair loads."""
    import os

    from kvsqueeze import recipe as recipe_module

    recipe = Recipe.load(recipe_copy)
    recipe.meta["text"] = "edited"
    real = os.replace
    calls = []

    def stop_at_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(recipe_module.os, "replace", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        recipe.save(recipe_copy)
    monkeypatch.setattr(recipe_module.os, "replace", real)
    assert (recipe_copy / f".{META_FILE}.staged").exists()
    assert Recipe.load(recipe_copy).meta["text"] == "edited"
    assert not list(recipe_copy.glob(".*.staged"))

    recipe.meta["text"] = "edited again"
    calls.clear()

    def stop_at_first(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe_module.os, "replace", stop_at_first)
    with pytest.raises(KeyboardInterrupt):
        recipe.save(recipe_copy)
    monkeypatch.setattr(recipe_module.os, "replace", real)
    assert Recipe.load(recipe_copy).meta["text"] == "edited"
    assert not list(recipe_copy.glob(".*.staged"))
