"""Tests for kvsqueeze.integrations.simulate (and kivi.py): simulated KV quantization inside a forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_ids
from kvsqueeze.eval.perplexity import evaluate, format_table, window_nll
from kvsqueeze.integrations.kivi import fake_quantize_channel_groups, fake_quantize_token_groups, kivi_attention
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import MethodError, parse_method
from kvsqueeze.numerics.affine import choose_qparams

BROAD = [
    "int3", "nf3", "int3:kchan:pre", "nuq2", "nuq3", "nuq4", "nuq2-1%", "nuq3-1%", "nuq4-1%",
    "nuq3-1%:pm", "nuq3:sink0", "nuq-k3v2-1%", "kivi2", "kivi4", "group3:g32", "int3-10%", "nf3-1%:kchan:pre",
    "nuq3-0.1%", "nuq3:unw", "nuq3:fisher", "kivi2:r32", "int3:vchan", "nuq3-1%:r16", "nuq-k3v2-1%:r8",
]


def logits(model, ids, name, recipe=None):
    with torch.no_grad(), SimulatedQuantization(model, parse_method(name), recipe) as sim:
        return model(input_ids=ids, cache=sim.new_cache(), use_cache=True).logits


def decode_logits(model, ids, name, recipe=None, prefill=1):
    """Logits [B, T, V] from a prefill of `prefill` tokens then one token at a time."""
    with torch.no_grad(), SimulatedQuantization(model, parse_method(name), recipe) as sim:
        cache = sim.new_cache()
        outs = [model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            outs.append(model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(outs, dim=1)


@pytest.fixture(scope="module")
def ids():
    return random_ids(2, 96, seed=7)


@pytest.fixture(scope="module")
def fp16_logits(tiny_llama, ids):
    return logits(tiny_llama, ids, "fp16")


# ---- a simulation and its cache ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int4", "nuq3-1%:r16"])
def test_a_simulation_whose_cache_does_part_of_the_method_needs_that_cache(tiny_llama, tiny_recipe, ids, name):
    """Post-RoPE keys are quantized as the simulated cache takes them, and a window's quantized copies are kept
    there: a forward with no cache, or another one, would leave those keys exact. Refused instead."""
    from transformers import DynamicCache

    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method(name), tiny_recipe) as sim:
        for cache in (None, DynamicCache()):
            with pytest.raises(ValueError, match="needs its own cache"):
                tiny_llama(input_ids=ids, cache=cache, use_cache=True)
        tiny_llama(input_ids=ids, cache=sim.new_cache(), use_cache=True)


def test_kivi_refuses_a_batch_padded_on_the_left(tiny_llama, tiny_recipe, ids):
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("kivi2"), tiny_recipe) as sim:
        with pytest.raises(ValueError, match="padded on the left"):
            tiny_llama(input_ids=ids, attention_mask=mask, cache=sim.new_cache(), use_cache=True)
        tiny_llama(input_ids=ids, attention_mask=torch.ones_like(ids), cache=sim.new_cache(), use_cache=True)


def test_pre_rope_methods_act_in_the_projections_alone(tiny_llama, tiny_recipe, ids):
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("nuq3-1%"), tiny_recipe) as sim:
        plain = tiny_llama(input_ids=ids).logits
        own = tiny_llama(input_ids=ids, cache=sim.new_cache(), use_cache=True).logits
    assert torch.equal(plain, own)


def test_a_compressed_cache_is_refused_while_a_simulation_holds_the_model(tiny_llama, tiny_recipe):
    import kvsqueeze

    with SimulatedQuantization(tiny_llama, parse_method("nuq3-1%"), tiny_recipe):
        with pytest.raises(RuntimeError, match="SimulatedQuantization of 'nuq3-1%' is active"):
            kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%")
        with pytest.raises(RuntimeError, match="already active"):
            SimulatedQuantization(tiny_llama, parse_method("int4"), tiny_recipe).__enter__()
    kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%").close()  # gone with the block


def test_a_simulation_refused_half_way_leaves_no_hooks_and_no_mark(tiny_llama, tiny_recipe, ids):
    """A windowed simulation on a model whose attention kvsqueeze cannot fall back on is refused as it switches
    the attention, after its hooks were placed: they are removed, and the model takes a compressed cache."""
    import kvsqueeze
    from kvsqueeze.integrations.preflight import UnsupportedModelError

    with torch.no_grad():
        plain = tiny_llama(input_ids=ids).logits
        tiny_llama.config._attn_implementation = "flex_attention"
        try:
            with pytest.raises(UnsupportedModelError, match="falls back on 'sdpa' or 'eager'"):
                SimulatedQuantization(tiny_llama, parse_method("nuq3-1%:r16"), tiny_recipe).__enter__()
        finally:
            tiny_llama.config._attn_implementation = "sdpa"
        assert torch.equal(tiny_llama(input_ids=ids).logits, plain)  # no quantizing hook left behind
    kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%").close()


# ---- fp16 is the model itself --------------------------------------------------------------------
def test_fp16_gives_the_models_own_loss(tiny_llama):
    windows = random_ids(3, 64, seed=11)
    with torch.no_grad():
        own = [float(tiny_llama(input_ids=w.view(1, -1), labels=w.view(1, -1)).loss) for w in windows]
    (row,) = evaluate(tiny_llama, windows, [parse_method("fp16")], progress=False)
    assert row.method == "fp16" and row.tokens == 3 * 63
    assert row.nll == pytest.approx(sum(own) / 3, rel=1e-6)
    assert row.ppl == pytest.approx(math.exp(sum(own) / 3), rel=1e-6)
    assert row.avg_bits == 16.0


def test_fp16_logits_equal_the_plain_forward(tiny_llama, ids, fp16_logits):
    with torch.no_grad():
        plain = tiny_llama(input_ids=ids).logits
    assert torch.allclose(fp16_logits, plain, atol=1e-6, rtol=0)


# ---- every method runs -----------------------------------------------------------------------------
def test_broad_method_list_gives_finite_ppl(tiny_llama, tiny_recipe):
    windows = random_ids(2, 64, seed=12)
    specs = [parse_method(n) for n in ["fp16", *BROAD]]
    rows = evaluate(tiny_llama, windows, specs, tiny_recipe, progress=False)
    assert [r.method for r in rows] == [s.name for s in specs]
    base = rows[0].ppl
    for r in rows:
        assert math.isfinite(r.ppl) and r.ppl > 1, r
        assert math.isfinite(r.avg_bits) and 2 < r.avg_bits <= 16, r
        if r.method not in ("fp16", "kivi2", "kivi4"):  # KIVI's 128-token window covers these windows
            assert r.ppl != base, f"{r.method} changed nothing"
    table = format_table(rows)
    assert "nuq3-1%" in table and "vs fp16" in table and "+0.00%" in table.splitlines()[1]


@pytest.mark.parametrize("family", ["int", "nf", "nuq", "nuq-1%", "group:g32", "kivi:r32", "int:kchan:pre"])
def test_four_bits_beat_two_bits(tiny_llama, tiny_recipe, ids, fp16_logits, family):
    def name(b):
        fam, _, rest = family.partition(":")
        base, _, pct = fam.partition("-")
        return f"{base}{b}" + (f"-{pct}" if pct else "") + (f":{rest}" if rest else "")

    err = {b: float((logits(tiny_llama, ids, name(b), tiny_recipe) - fp16_logits).pow(2).mean()) for b in (2, 4)}
    assert err[4] < err[2] / 4, err
    assert err[4] > 0


def test_error_shrinks_with_every_bit(tiny_llama, tiny_recipe, ids, fp16_logits):
    for fam in ("int", "nuq"):
        err = [float((logits(tiny_llama, ids, f"{fam}{b}", tiny_recipe) - fp16_logits).pow(2).mean())
               for b in (2, 3, 4)]
        assert err[0] > err[1] > err[2], (fam, err)


# ---- sinks -----------------------------------------------------------------------------------------
def _capture_layer0(model, ids, name, recipe):
    """Layer-0 k_proj / v_proj outputs as the model uses them (after the quantization hook)."""
    attn = model.model.layers[0].self_attn
    seen = {}
    with torch.no_grad(), SimulatedQuantization(model, parse_method(name), recipe) as sim:
        hs = [attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o.clone())),
              attn.v_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("v", o.clone()))]
        try:
            model(input_ids=ids, cache=sim.new_cache(), use_cache=True)
        finally:
            for h in hs:
                h.remove()
    return seen["k"], seen["v"]


@pytest.mark.parametrize("name,sinks", [("nuq3", 1), ("nuq3:sink3", 3), ("nuq2-1%", 1), ("int3:vchan:sink2", 2)])
def test_sink_tokens_pass_through_exactly(tiny_llama, tiny_recipe, ids, name, sinks):
    raw_k, raw_v = _capture_layer0(tiny_llama, ids, "fp16", None)
    k, v = _capture_layer0(tiny_llama, ids, name, tiny_recipe)
    spec = parse_method(name)
    pairs = [(v, raw_v)] + ([(k, raw_k)] if spec.key_rope == "pre" else [])  # post-RoPE keys: see below
    for got, raw in pairs:
        assert torch.equal(got[:, :sinks], raw[:, :sinks].half().float())
        assert not torch.equal(got[:, sinks], raw[:, sinks].half().float())
        assert (got[:, sinks:] - raw[:, sinks:]).abs().max() > 0


def test_sink0_quantizes_the_first_token(tiny_llama, tiny_recipe, ids):
    raw_k, _ = _capture_layer0(tiny_llama, ids, "fp16", None)
    k, _ = _capture_layer0(tiny_llama, ids, "nuq3:sink0", tiny_recipe)
    assert not torch.allclose(k[:, 0], raw_k[:, 0], atol=1e-3)


def test_post_rope_sinks_stay_exact_in_the_cache(tiny_llama, ids):
    caches = {}
    for name in ("fp16", "int3:sink1"):
        with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method(name)) as sim:
            cache = sim.new_cache()
            tiny_llama(input_ids=ids, cache=cache, use_cache=True)
            caches[name] = cache.layers[0].keys  # [B, H_kv, T, D] post-RoPE
    ref, got = caches["fp16"], caches["int3:sink1"]
    assert torch.equal(got[:, :, 0], ref[:, :, 0].half().float())
    assert (got[:, :, 1:] - ref[:, :, 1:]).abs().max() > 1e-3


def test_sinks_follow_absolute_positions_when_decoding(tiny_llama, tiny_recipe, ids):
    """With 3 sinks, a prefill of 2 tokens then one more: that third token is still a sink."""
    attn = tiny_llama.model.layers[0].self_attn
    seen = []
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("nuq3:sink3"), tiny_recipe) as sim:
        h = attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        try:
            cache = sim.new_cache()
            tiny_llama(input_ids=ids[:, :2], cache=cache, use_cache=True)
            tiny_llama(input_ids=ids[:, 2:3], cache=cache, use_cache=True)
            tiny_llama(input_ids=ids[:, 3:4], cache=cache, use_cache=True)
        finally:
            h.remove()
    raw_k, _ = _capture_layer0(tiny_llama, ids[:, :4], "fp16", None)
    assert torch.equal(seen[1][:, 0], raw_k[:, 2].half().float())
    assert not torch.equal(seen[2][:, 0], raw_k[:, 3].half().float())


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp16", "nuq3-1%", "kivi2"])
def test_nan_activations_raise(tiny_llama, tiny_recipe, ids, name):
    def poison(module, inputs, output):
        out = output.clone()
        out[0, 5, 3] = float("nan")
        return out

    h = tiny_llama.get_input_embeddings().register_forward_hook(poison)
    try:
        with pytest.raises(FloatingPointError, match=r"layer 0 \w+ activations holds \d+ NaN/Inf values.*float32"):
            logits(tiny_llama, ids, name, tiny_recipe)
    finally:
        h.remove()


def test_hooks_removed_after_exit_even_on_error(tiny_llama, tiny_recipe, ids, fp16_logits):
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny_llama.modules())
    with pytest.raises(RuntimeError, match="boom"):
        with SimulatedQuantization(tiny_llama, parse_method("kivi2:r32"), tiny_recipe):
            assert tiny_llama.config._attn_implementation == "kvsqueeze"
            raise RuntimeError("boom")
    with SimulatedQuantization(tiny_llama, parse_method("nuq2-1%"), tiny_recipe):
        pass
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny_llama.modules()) == n_hooks
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "kvsqueeze_kivi") for m in tiny_llama.modules())
    with torch.no_grad():
        assert torch.allclose(tiny_llama(input_ids=ids).logits, fp16_logits, atol=1e-6, rtol=0)


# ---- KIVI ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kivi2", "kivi2:r96", "kivi4:g16:r256"])
def test_kivi_window_covering_the_sequence_is_fp16(tiny_llama, ids, fp16_logits, name):
    assert parse_method(name).window >= ids.shape[1]
    assert torch.allclose(logits(tiny_llama, ids, name), fp16_logits, atol=1e-5, rtol=0)


def test_kivi_short_window_quantizes(tiny_llama, ids, fp16_logits):
    out = logits(tiny_llama, ids, "kivi2:r32")
    # the first 32 positions only see their fp16 window
    assert torch.allclose(out[:, :32], fp16_logits[:, :32], atol=1e-5, rtol=0)
    # position 32 is the first whose oldest key (token 0) has left the 32-token window
    assert (out[:, 32] - fp16_logits[:, 32]).abs().max() > 1e-4
    assert (out[:, 40:] - fp16_logits[:, 40:]).abs().max() > 1e-2


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
@pytest.mark.parametrize("tq", [1, 5, 60])
def test_kivi_attention_equals_per_query_reference(chunk, tq):
    """Every query sees keys older than its window quantized and the rest exact, whatever the chunking."""
    g = torch.Generator().manual_seed(3)
    spec = parse_method("kivi2:r16:g8")
    tk = 60
    q = torch.randn(2, 6, tq, 16, generator=g)
    k = torch.randn(2, 3, tk, 16, generator=g)
    v = torch.randn(2, 3, tk, 16, generator=g)
    out, _ = kivi_attention(None, q, k, v, None, 0.25, spec, chunk=chunk)  # [B, Tq, H, D]
    kq = fake_quantize_token_groups(k, 8, 2).repeat_interleave(2, dim=1)
    vq = fake_quantize_channel_groups(v, 8, 2).repeat_interleave(2, dim=1)
    ke, ve = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for r in range(tq):
        i = tk - tq + r
        old = torch.arange(i + 1) <= i - 16
        keys = torch.where(old[:, None], kq[:, :, : i + 1], ke[:, :, : i + 1])
        vals = torch.where(old[:, None], vq[:, :, : i + 1], ve[:, :, : i + 1])
        w = torch.softmax(torch.einsum("bhd,bhtd->bht", q[:, :, r], keys) * 0.25, dim=-1)
        ref = torch.einsum("bht,bhtd->bhd", w, vals)
        assert torch.allclose(out[:, r], ref, atol=1e-5, rtol=0), (r, float((out[:, r] - ref).abs().max()))


def test_kivi_token_groups_bound():
    k = torch.randn(2, 3, 70, 16, generator=torch.Generator().manual_seed(0))
    out = fake_quantize_token_groups(k, 32, 2)
    for start in range(0, 70, 32):
        part = k[:, :, start : start + 32]
        s, _ = choose_qparams(part.amin(2, keepdim=True), part.amax(2, keepdim=True))
        assert torch.all((out[:, :, start : start + 32] - part).abs() <= s / 3 + 1e-3)


def test_kivi_channel_groups_use_only_their_own_channels():
    """The last, partial channel group's range comes from its own channels only (not widened by padding it with
    each token's first channel, which is large here)."""
    v = torch.randn(1, 2, 5, 20, generator=torch.Generator().manual_seed(0))  # 40 channels, groups of 32
    v[:, 0, :, 0] = 30.0
    out = fake_quantize_channel_groups(v, 32, 2)
    flat_v = v.transpose(1, 2).reshape(1, 5, 40)
    flat_o = out.transpose(1, 2).reshape(1, 5, 40)
    tail = flat_v[..., 32:]
    s, _ = choose_qparams(tail.amin(-1, keepdim=True), tail.amax(-1, keepdim=True))
    assert torch.all((flat_o[..., 32:] - tail).abs() <= s / 3 + 1e-3)


# ---- decoding, batching and causality --------------------------------------------------------------
@pytest.mark.parametrize("name", ["nuq3-1%", "int3", "int3-10%", "nuq-k3v2-1%", "group3:g32", "nuq2-1%:pm",
                                  "int3:kchan:pre", "kivi2:r32", "nuq3-1%:r8", "nuq-k3v2-1%:r4"])
def test_token_by_token_decoding_matches_the_whole_window(tiny_llama, tiny_recipe, name):
    ids = random_ids(1, 48, seed=21)
    whole = logits(tiny_llama, ids, name, tiny_recipe)
    step = decode_logits(tiny_llama, ids, name, tiny_recipe, prefill=1)
    assert torch.allclose(step, whole, atol=1e-4, rtol=0), float((step - whole).abs().max())


@pytest.mark.parametrize("name", ["nuq3-1%", "int3", "kivi2:r32", "group3:g32", "int3-1%:pm", "nuq3-1%:r8"])
def test_batch_rows_are_independent(tiny_llama, tiny_recipe, ids, name):
    both = logits(tiny_llama, ids, name, tiny_recipe)
    for row in range(ids.shape[0]):
        alone = logits(tiny_llama, ids[row : row + 1], name, tiny_recipe)
        assert torch.allclose(both[row : row + 1], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["nuq3-1%", "int3", "int3-10%", "group3:g32", "nuq3-1%:pm", "kivi2:r32",
                                  "kivi2:r64:g16", "nuq3-1%:r8"])
def test_future_tokens_do_not_change_past_logits(tiny_llama, tiny_recipe, ids, name):
    """Causality: what position i predicts must not depend on tokens after i."""
    cut = 50
    other = ids.clone()
    other[:, cut:] = random_ids(2, ids.shape[1] - cut, seed=99)
    a = logits(tiny_llama, ids, name, tiny_recipe)
    b = logits(tiny_llama, other, name, tiny_recipe)
    assert torch.allclose(a[:, :cut], b[:, :cut], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["kivi2:r8", "kivi2:r0"])
def test_a_kivi_window_shorter_than_a_key_group_is_refused(name):
    """KIVI quantizes keys per channel over groups of G tokens; a group's scale is causal only when the group is
    complete before any of its tokens leaves the fp16 window (window >= G = 32), so shorter windows are refused."""
    with pytest.raises(MethodError, match="must hold at least one key group"):
        parse_method(name)


def test_kivi_sinks_are_refused():
    """The KIVI attention reads no sinks: a sink count would be stored and counted but change nothing."""
    with pytest.raises(MethodError, match="KIVI has no attention sinks"):
        parse_method("kivi2:r32:sink4")


# ---- accounting --------------------------------------------------------------------------------------
def test_outliers_counted_per_layer(tiny_llama, ids):
    b, t = ids.shape
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("int3-10%")) as sim:
        tiny_llama(input_ids=ids, cache=sim.new_cache(), use_cache=True)
        # 32 channels at 10%: round(1.6) = 2 outliers per side for every K and V token
        assert sim.counter.k == [4 * b * t] * 2 and sim.counter.v == [4 * b * t] * 2
        st = sim.storage(t, batch=b)  # bytes by component
        assert 8 * st["outlier_values"] == pytest.approx(16 * 2 * 2 * 4 * t * b)
        sim.new_cache()
        assert sim.counter.k == [0, 0], "a new cache resets the counts"


def test_storage_with_a_recipe(tiny_llama, tiny_recipe, ids):
    b, t = ids.shape
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("nuq3-1%"), tiny_recipe) as sim:
        nll, n = window_nll(tiny_llama, ids, sim)
        assert n == b * (t - 1) and math.isfinite(nll)
        assert sum(sim.counter.k) > 0  # keys: calibrated per-channel thresholds
        assert sim.counter.v == [0, 0]  # values: 1% of 32 channels rounds to 0 per side
        st = sim.storage(t, batch=b)
    assert 8 * st["outlier_values"] == 16 * sum(sim.counter.k)  # keys' outliers; values keep none
    assert 3 < 8 * sum(st.values()) / (2 * b * t * 32 * 2) < 16


def test_left_padding_over_the_sinks_is_refused_not_kept_as_sinks(tiny_llama, tiny_recipe):
    """The simulated path keeps absolute positions 0..sinks-1 exact: with left padding those are pads."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        with SimulatedQuantization(tiny_llama, parse_method("nuq3-1%:sink2"), tiny_recipe) as sim:
            with pytest.raises(ValueError, match="padded on the left"):
                tiny_llama(ids, attention_mask=mask, cache=sim.new_cache(), use_cache=True)
            right = torch.ones_like(ids)
            right[1, -3:] = 0  # padding on the right leaves the sinks real
            tiny_llama(ids, attention_mask=right, cache=sim.new_cache(), use_cache=True)
        with SimulatedQuantization(tiny_llama, parse_method("int3"), tiny_recipe) as sim:  # no sinks: no refusal
            tiny_llama(ids, attention_mask=mask, cache=sim.new_cache(), use_cache=True)


def test_kivi_reuses_the_quantized_prefix_exactly():
    """A module's memo of quantized keys and values gives the very numbers quantizing everything gives, as the
    sequence grows token by token, is cropped back, or is replaced by another one."""
    from kvsqueeze.integrations import kivi

    spec = parse_method("kivi2:g8:r16")
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    other = torch.randn(1, 2, 40, 16, generator=g)
    for t in [*range(20, 70, 7), 33, 33, 65]:  # growing, repeated, cropped back, grown again
        got = kivi.quantized_kv(module, k[:, :, :t], v[:, :, :t], spec)
        want = kivi.quantized_kv(None, k[:, :, :t], v[:, :, :t], spec)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = kivi.quantized_kv(module, other, other, spec)  # another sequence: nothing reused
    assert torch.equal(got[0], fake_quantize_token_groups(other, 8, 2))
    kivi.forget([module])
    assert module not in kivi._MEMO
