"""nuq with an fp16 window of recent tokens (`:rN`): names, bits, budgets and the simulated path."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids
from kvsqueeze.methods.budget import allocate, allocate_channels
from kvsqueeze.cache.store import WindowCropError
from kvsqueeze.integrations.cache import cache_for
from kvsqueeze.kernels.mixed import mixed_attention
from kvsqueeze.integrations.simulate import SimulatedQuantization
from conftest import layer_bits as storage_bits
from kvsqueeze.methods import MethodError, average_bits, parse_method
from kvsqueeze.methods.spec import DEFAULT_CONTEXT
from kvsqueeze.shape import kv_shape


pytestmark = pytest.mark.usefixtures("own_attention")  # a windowed cache selects kvsqueeze's attention


def test_a_windowed_cache_selects_kvsqueeze_attention(tiny_llama, tiny_recipe):
    from kvsqueeze.integrations.attention import ATTN_NAME

    cache_for(tiny_llama, tiny_recipe, "nuq3-1%")
    assert tiny_llama.config._attn_implementation == "sdpa"  # a plain method leaves the model as it is
    cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r8")
    assert tiny_llama.config._attn_implementation == ATTN_NAME


def logits(model, ids, name, recipe=None):
    with torch.no_grad(), SimulatedQuantization(model, parse_method(name), recipe) as sim:
        return model(input_ids=ids, cache=sim.new_cache(), use_cache=True).logits


def kld(ref, out):
    p = ref.log_softmax(-1)
    return float((p.exp() * (p - out.log_softmax(-1))).sum(-1).mean())


@pytest.mark.parametrize("name, canonical, window", [
    ("nuq3-1%:r16", "nuq3-1%:r16", 16),
    ("nuq@4.58:chan:r16", "nuq@4.58:r16:chan", 16),
    ("nuq@3.5:kl:r32", "nuq@3.5:r32:kl", 32),
    ("nuq3-1%:r0", "nuq3-1%", 0),
    ("kivi2", "kivi2", 128),
])
def test_window_names_round_trip(name, canonical, window):
    spec = parse_method(name)
    assert spec.window == window and spec.name == canonical
    assert parse_method(spec.name) == spec


@pytest.mark.parametrize("name", ["int3:r16", "nf3:r8", "turbo3:r4", "group3:r8"])
def test_window_refused_where_the_family_has_none(name):
    with pytest.raises(MethodError, match="fp16 window"):
        parse_method(name)


def test_window_bits_are_counted_beside_the_codes():
    plain, windowed = (storage_bits(parse_method(n), 300, 64) for n in ("nuq3-1%", "nuq3-1%:r16"))
    assert windowed["codes"] == plain["codes"]  # the window's tokens keep their codes
    assert windowed["fp16_window"] - plain["fp16_window"] == 2 * 16 * 64 * 16  # K and V, fp16
    assert windowed["total"] - plain["total"] == 2 * 16 * 64 * 16 + 16 * 32  # and an int32 slot entry each
    short = storage_bits(parse_method("nuq3-1%:r16"), 10, 64)  # 1 sink + 9 tokens: the window holds 9
    assert short["fp16_window"] == 2 * 9 * 64 * 16
    kivi = storage_bits(parse_method("kivi2:r32"), 300, 64)  # KIVI's window replaces codes (unchanged)
    assert kivi["codes"] == (300 - 32) * 64 * 4


@pytest.mark.parametrize("alloc_fn", [allocate, allocate_channels])
def test_budget_pays_for_its_window(tiny_recipe, alloc_fn):
    """A window's fp16 copies count against the budget: the choice stays within it, and less is left for codes."""
    plain, windowed = alloc_fn(tiny_recipe, 4.0), alloc_fn(tiny_recipe, 4.0, window=32)
    assert windowed.window == 32 and windowed.bits <= 4.0 + 1e-9 and plain.bits <= 4.0 + 1e-9
    assert windowed.predicted > plain.predicted
    spec = parse_method("nuq@4:r32" + (":chan" if alloc_fn is allocate_channels else ""))
    fp = tiny_recipe.meta["model"]["fingerprint"]
    channels = int(fp["kv_heads"]) * int(fp["head_dim"])
    held = average_bits(spec, int(fp["layers"]), channels, int(fp["head_dim"]), DEFAULT_CONTEXT, tiny_recipe)
    assert held == pytest.approx(windowed.bits, rel=1e-12)


@pytest.mark.parametrize("chunk", [None, 1, 7])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_mixed_attention_equals_per_query_reference(chunk, window):
    g = torch.Generator().manual_seed(5)
    tq, tk = 12, 40
    q = torch.randn(2, 6, tq, 16, generator=g)
    k, v = torch.randn(2, 3, tk, 16, generator=g), torch.randn(2, 3, tk, 16, generator=g)
    kq, vq = k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g)
    out, _ = mixed_attention(q, k, v, kq, vq, None, 0.25, window, chunk=chunk)
    rep = [x.repeat_interleave(2, dim=1) for x in (k, v, kq, vq)]
    for r in range(tq):
        i = tk - tq + r
        old = (i - torch.arange(i + 1) >= window)[:, None]
        keys = torch.where(old, rep[2][:, :, : i + 1], rep[0][:, :, : i + 1])
        vals = torch.where(old, rep[3][:, :, : i + 1], rep[1][:, :, : i + 1])
        w = torch.softmax(torch.einsum("bhd,bhtd->bht", q[:, :, r], keys) * 0.25, dim=-1)
        assert torch.allclose(out[:, r], torch.einsum("bht,bhtd->bhd", w, vals), atol=1e-5, rtol=0)
    # the exact copy cut to the keys the queries' windows reach gives the same attention
    start = max(0, tk - tq - window + 1)
    tail, _ = mixed_attention(q, k[:, :, start:], v[:, :, start:], kq, vq, None, 0.25, window, chunk=chunk, start=start)
    assert torch.equal(tail, out)


@pytest.mark.parametrize("window,start", [(32, 0), (32, "late"), (7, 0), (500, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_attention_by_parts_over_several_bands_equals_the_chunked_path(window, start, dtype):
    from kvsqueeze.kernels.mixed import BAND

    g = torch.Generator().manual_seed(7)
    tq, tk = BAND + 45, 2 * BAND + 100  # more queries than one band holds
    q = torch.randn(1, 6, tq, 16, generator=g)
    k, v = torch.randn(1, 2, tk, 16, generator=g), torch.randn(1, 2, tk, 16, generator=g)
    kq, vq = k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g)
    start = max(0, tk - tq - window + 1) if start == "late" else 0
    want, _ = mixed_attention(q.double(), k.double(), v.double(), kq.double(), vq.double(), None, 0.25, window,
                              chunk=64)  # the masked-SDPA path, in float64
    args = [x.to(dtype) for x in (q, k[:, :, start:], v[:, :, start:], kq, vq)]
    got, _ = mixed_attention(*args[:3], *args[3:], None, 0.25, window, start=start)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_query_heads_of_a_kv_head_attend_as_rows_of_it(dtype, masked, monkeypatch):
    """Without a causal mask a part's G query heads per KV head attend as G * Tq rows of that head, over keys read
    in place: each query head's attention and log-sum-exp over its own copy of the keys (what the part computed
    before), to float rounding (the kernel blocks the rows by their count), and float64's."""
    from kvsqueeze.kernels.mixed import _FLASH, GROUPED_ROWS, _part

    g = torch.Generator().manual_seed(3)
    b, h, group, tq, tk, d = 2, 2, 7, 37, 300, 64
    assert tq <= GROUPED_ROWS
    q = torch.randn(b, h * group, tq, d, generator=g)
    k, v = (torch.randn(b, h, tk, d, generator=g) for _ in range(2))
    mask = None
    if masked:  # a band: each query reads a window of keys ending at its own
        gap = torch.arange(tk - tq, tk)[:, None] - torch.arange(tk)[None, :]
        mask = torch.zeros(gap.shape).masked_fill_((gap < 0) | (gap >= 50), float("-inf")).expand(b, 1, tq, tk)
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.double() @ kk.double().transpose(-1, -2)) * 0.125 + (0 if mask is None else mask.double())
    exact, exact_lse = scores.softmax(-1) @ vv.double(), scores.logsumexp(-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    cast = (lambda x: x) if mask is None else (lambda x: x.to(dtype))
    from kvsqueeze.kernels import mixed

    shapes = []
    monkeypatch.setattr(mixed, "_FLASH", lambda query, *a, **kw: shapes.append(tuple(query.shape)) or _FLASH(query, *a,
                                                                                                             **kw))
    out, lse = _part(q.to(dtype), k.to(dtype), v.to(dtype), 0.125, False, None if mask is None else cast(mask))
    assert shapes == [(b, h, group * tq, d)]  # the query heads as rows of their KV head
    before = _FLASH(q.to(dtype), kk.to(dtype), vv.to(dtype), 0.0, False,
                    attn_mask=None if mask is None else cast(mask), scale=0.125)[:2]
    assert out.shape == before[0].shape == exact.shape and lse.shape == before[1].shape == exact_lse.shape
    for got in (out, before[0]):
        torch.testing.assert_close(got.double(), exact, atol=tol, rtol=tol)
    for got in (lse, before[1]):
        torch.testing.assert_close(got.double(), exact_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), before[0].float(), atol=tol, rtol=tol)


def test_mixed_attention_refuses_an_exact_copy_that_starts_too_late():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 20, 8)
    mixed_attention(q, k[:, :, 12:], k[:, :, 12:], k, k, None, 0.25, 5, start=12)  # query 16 reads 12 exact
    with pytest.raises(ValueError, match="exact keys of positions 13..19 .* window of 5"):
        mixed_attention(q, k[:, :, 13:], k[:, :, 13:], k, k, None, 0.25, 5, start=13)
    with pytest.raises(ValueError, match="exact keys of positions 12..18 "):  # the last key is missing
        mixed_attention(q, k[:, :, 12:19], k[:, :, 12:19], k, k, None, 0.25, 5, start=12)


def test_window_covering_the_sequence_reads_fp16(tiny_llama, tiny_recipe):
    ids = random_ids(2, 64, seed=4)
    exact = logits(tiny_llama, ids, "fp16")
    covered = logits(tiny_llama, ids, "nuq2-1%:r64", tiny_recipe)
    plain = logits(tiny_llama, ids, "nuq2-1%", tiny_recipe)
    assert (covered - exact).abs().max() < 1e-2  # fp16 rounding of keys and values only
    assert kld(exact, covered) < 1e-3 * kld(exact, plain)


def test_short_window_reads_old_tokens_quantized(tiny_llama, tiny_recipe):
    ids = random_ids(1, 64, seed=6)
    exact = logits(tiny_llama, ids, "fp16")
    out = logits(tiny_llama, ids, "nuq2-1%:r8", tiny_recipe)
    plain = logits(tiny_llama, ids, "nuq2-1%", tiny_recipe)
    # positions 0-7 see only their window (the fp16 copies); from position 9 on, the first non-sink token is old
    assert (out[:, :8] - exact[:, :8]).abs().max() < 1e-2
    assert (out[:, 20:] - exact[:, 20:]).abs().max() > 1e-2
    assert kld(exact, out) < kld(exact, plain)


def test_window_storage_is_reported(tiny_llama, tiny_recipe):
    ids = random_ids(1, 64, seed=7)
    shape = kv_shape(tiny_llama.config)
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method("nuq3-1%:r16"), tiny_recipe) as sim:
        tiny_llama(input_ids=ids, cache=sim.new_cache(), use_cache=True)
        st = sim.storage(64)
    assert 8 * st["fp16_window"] == shape.layers * 2 * 16 * shape.channels * 16  # bytes held, in bits


# ---- the compressed cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [40, 17, 1])
@pytest.mark.parametrize("name", ["nuq3-1%:r8", "nuq2:r3"])
def test_compressed_cache_reads_the_window_as_the_simulated_path(tiny_llama, tiny_recipe, name, prefill):
    """A forward of many tokens (each query its own window) and decode steps (the window from the store's table)
    give the simulated path's logits."""
    ids = random_ids(1, 40, seed=8)
    ref = logits(tiny_llama, ids, name, tiny_recipe)
    cache = cache_for(tiny_llama, tiny_recipe, name)
    with torch.no_grad():
        outs = [tiny_llama(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits]
        for t in range(prefill, 40):
            outs.append(tiny_llama(input_ids=ids[:, t: t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=1e-4, rtol=1e-4)
    store = cache.layers[0].store
    window = parse_method(name).window
    assert sorted(store.window_entries()[2][0].tolist()) == list(range(40 - window, 40))


@pytest.mark.parametrize("name", ["nuq3-1%:r8", "nuq2:r3"])
def test_forwards_of_several_tokens_on_a_filled_cache_read_the_window(tiny_llama, tiny_recipe, name):
    """Forwards of several tokens after the first (a prompt in chunks, a second turn) read the window held before
    them and their own tokens in fp16 and older tokens from their codes, as the simulated path does."""
    ids = random_ids(2, 48, seed=12)
    ref = logits(tiny_llama, ids, name, tiny_recipe)
    cache = cache_for(tiny_llama, tiny_recipe, name)
    outs, at = [], 0
    with torch.no_grad():
        for size in (13, 9, 1, 2, 23):
            outs.append(tiny_llama(input_ids=ids[:, at: at + size], cache=cache, use_cache=True).logits)
            at += size
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_fused_decode_reads_the_window(tiny_llama, tiny_recipe, backend):
    from kvsqueeze.integrations.fused import fused_decode

    name = "nuq3-1%:r8"
    ids = random_ids(1, 12, seed=9)
    with torch.no_grad(), SimulatedQuantization(tiny_llama, parse_method(name), tiny_recipe) as sim:
        ref = tiny_llama.generate(ids, cache=sim.new_cache(), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
    cache = cache_for(tiny_llama, tiny_recipe, name)
    with torch.no_grad(), fused_decode(tiny_llama, cache, backend):
        got = tiny_llama.generate(ids, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_beam_search_reorders_the_window_like_the_simulated_cache(tiny_llama, tiny_recipe):
    name = "nuq3-1%:r8"
    ids = random_ids(1, 10, seed=4)
    kw = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, num_beams=3)
    with torch.no_grad():
        with SimulatedQuantization(tiny_llama, parse_method(name), tiny_recipe) as sim:
            ref = tiny_llama.generate(ids, cache=sim.new_cache(), **kw)
        got = tiny_llama.generate(ids, cache=cache_for(tiny_llama, tiny_recipe, name), **kw)
    assert torch.equal(got, ref)


def test_window_table_holds_the_last_real_tokens(tiny_llama, tiny_recipe):
    """Chunked appends, left padding and sinks: each row's window is its last `window` real non-sink tokens, fp16."""
    from kvsqueeze.cache.store import KVStore
    from kvsqueeze.methods import build_quantizers

    kq, vq = build_quantizers(parse_method("nuq3-1%"), tiny_recipe, 0, 32)
    store = KVStore(kq, vq, 32, sinks=2, head_dim=16, window=5)
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 23, 32, generator=g), torch.randn(2, 23, 32, generator=g)
    real = torch.ones(2, 23, dtype=torch.bool)
    real[1, :9] = False  # row 1: 9 pads, then 14 real tokens
    for lo, hi in ((0, 4), (4, 5), (5, 13), (13, 23)):
        store.append(keys[:, lo:hi], values[:, lo:hi], real[:, lo:hi])
        for row in range(2):
            firsts = real[row, :hi].nonzero().view(-1)
            eligible = firsts[2:]  # the first 2 real tokens are sinks
            want = eligible[-5:].tolist()
            k, v, slot = (x[row] for x in store.window_entries())
            held = slot[slot >= 0]
            assert sorted(held.tolist()) == want
            for e in (slot >= 0).nonzero().view(-1).tolist():
                assert torch.equal(k[e], keys[row, slot[e]].half()) and torch.equal(v[e], values[row, slot[e]].half())
    assert store.sink_count.tolist() == [2, 2] and store.window_count.tolist() == [5, 5]
    # cutting tokens 20-22 would let 15-17 back into the window, whose fp16 copies were overwritten
    before = [x.clone() for x in store.window_entries()]
    with pytest.raises(WindowCropError, match="without their fp16 copies"):
        store.crop(20)
    assert store.tokens == 23 and all(torch.equal(a, b) for a, b in zip(before, store.window_entries()))
    state = store.window_state()  # at 23 tokens: a crop back to here restores the window exactly
    more_k, more_v = torch.randn(2, 9, 32, generator=g), torch.randn(2, 9, 32, generator=g)
    store.append(more_k, more_v)
    with pytest.raises(ValueError, match="restores a crop to 23 tokens"):
        store.crop(22, state)
    store.crop(23, state)
    assert store.tokens == 23 and all(torch.equal(a, b) for a, b in zip(before, store.window_entries()))
    store.append(more_k[:, :2], more_v[:, :2])
    assert sorted(store.window_entries()[2][0].tolist()) == [20, 21, 22, 23, 24]


def test_a_window_that_has_not_wrapped_crops_without_a_state(tiny_recipe):
    """While no row's window has taken more than its size, every token it held is still there: a crop keeps
    the entries of the tokens left, oldest first, and the window fills again from them."""
    from kvsqueeze.cache.store import KVStore
    from kvsqueeze.methods import build_quantizers

    kq, vq = build_quantizers(parse_method("nuq3-1%"), tiny_recipe, 0, 32)
    store = KVStore(kq, vq, 32, sinks=1, head_dim=16, window=8)
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 12, 32, generator=g), torch.randn(1, 12, 32, generator=g)
    store.append(keys[:, :7], values[:, :7])  # 1 sink and 6 window tokens
    store.crop(4)
    assert sorted(s for s in store.window_entries()[2][0].tolist() if s >= 0) == [1, 2, 3]
    store.append(keys[:, 4:12], values[:, 4:12])
    assert sorted(store.window_entries()[2][0].tolist()) == list(range(4, 12))


def test_memory_report_counts_the_window(tiny_llama, tiny_recipe):
    spec = parse_method("nuq3-1%:r8")
    cache = cache_for(tiny_llama, tiny_recipe, spec)
    with torch.no_grad():
        tiny_llama(random_ids(1, 30, seed=6), cache=cache, use_cache=True)
    rep = cache.memory_report()
    expected = sum(storage_bits(spec, 30, 32)["fp16_window"] for _ in cache.layers)
    assert rep.components["fp16_window"] * 8 == expected
    plain = storage_bits(parse_method("nuq3-1%"), 30, 32)
    assert rep.components["codes"] * 8 == plain["codes"] * len(cache.layers)  # window tokens keep their codes


def test_window_needs_kvsqueeze_attention(tiny_llama, tiny_recipe):
    cache = cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r8")
    saved = tiny_llama.config._attn_implementation
    tiny_llama.set_attn_implementation("sdpa")
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="fp16"):
            tiny_llama(random_ids(1, 10, seed=2), cache=cache, use_cache=True)
    finally:
        tiny_llama.set_attn_implementation(saved)


def test_a_deep_copy_of_a_windowed_cache_decodes_alike(tiny_llama, tiny_recipe):
    import copy

    ids = random_ids(1, 20, seed=12)
    cache = cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r8")
    with torch.no_grad():
        tiny_llama(input_ids=ids[:, :16], cache=cache, use_cache=True)
        dup = copy.deepcopy(cache)
        assert all(layer.attention_config is tiny_llama.config for layer in dup.layers)
        a = tiny_llama(input_ids=ids[:, 16:], cache=cache, use_cache=True).logits
        b = tiny_llama(input_ids=ids[:, 16:], cache=dup, use_cache=True).logits
    assert torch.equal(a, b)


def test_a_rollback_returns_a_windowed_cache_to_its_checkpoint_exactly(tiny_llama, tiny_recipe):
    """A question asked of a context and answered (more tokens than the window), then rolled back: the next
    tokens read the context as a cache that never saw the question does, the context's last tokens in fp16.
    A plain crop there is refused before any layer changes."""
    ids = random_ids(1, 60, seed=13)
    fresh, asked = (cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r8") for _ in range(2))
    with torch.no_grad():
        for cache in (fresh, asked):
            tiny_llama(input_ids=ids[:, :40], cache=cache, use_cache=True)
        mark = asked.checkpoint()
        asked.batch_repeat_interleave(2)
        tiny_llama(input_ids=ids[:, 40:52].expand(2, -1), cache=asked, use_cache=True)  # the question, twice
        tiny_llama(input_ids=ids[:, 52:53].expand(2, -1), cache=asked, use_cache=True)
        with pytest.raises(WindowCropError, match="cache.checkpoint"):
            asked.crop(-13)
        assert asked.get_seq_length() == 53 and all(layer.store.tokens == 53 for layer in asked.layers)
        with pytest.raises(ValueError, match="select the rows back"):
            asked.rollback(mark)
        asked.batch_select_indices(torch.zeros(1, dtype=torch.long))
        asked.rollback(mark)
        assert asked.get_seq_length() == 40
        for a, b in zip(asked.layers, fresh.layers):
            assert all(torch.equal(x, y) for x, y in zip(a.store.window_entries(), b.store.window_entries()))
        got = tiny_llama(input_ids=ids[:, 40:44], cache=asked, use_cache=True).logits
        want = tiny_llama(input_ids=ids[:, 40:44], cache=fresh, use_cache=True).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["nuq3-1%:r4", "nuq3-1%"])
def test_a_rollback_to_rows_or_tokens_the_cache_no_longer_holds_is_refused(tiny_llama, tiny_recipe, method):
    """A checkpoint describes its rows in their order and the tokens up to it: after the rows were swapped, or
    after a crop below it and new tokens, a rollback would mix the checkpoint's window tables (or its promise of
    its tokens) with other rows' or tokens' codes; both are refused. Rows selected back to the checkpoint's
    order roll back as before."""
    ids = random_ids(2, 12, seed=14)
    with torch.no_grad():
        cache = cache_for(tiny_llama, tiny_recipe, method)
        tiny_llama(input_ids=ids[:, :8], cache=cache, use_cache=True)
        mark = cache.checkpoint()
        tiny_llama(input_ids=ids[:, 8:10], cache=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([1, 0]))
        with pytest.raises(ValueError, match="rows are not those of this checkpoint"):
            cache.rollback(mark)
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.rollback(mark)
        assert cache.get_seq_length() == 8

        cache = cache_for(tiny_llama, tiny_recipe, method)  # the window not yet wrapped: a crop is allowed
        tiny_llama(input_ids=ids[:, :3], cache=cache, use_cache=True)
        mark = cache.checkpoint()
        cache.crop(-2)
        tiny_llama(input_ids=ids[:, 8:10], cache=cache, use_cache=True)  # 3 tokens again, 2 of them new
        with pytest.raises(ValueError, match="cropped to 1 tokens after this checkpoint at 3"):
            cache.rollback(mark)


def test_assisted_decoding_is_refused_up_front_where_a_crop_cannot_undo_a_draft(tiny_llama, tiny_recipe):
    """transformers asks a cache whether crop puts it back before it crops rejected draft tokens: a windowed store
    says no (a crop past its wrap loses exact copies), and generation is refused after the prompt instead of
    failing part way; a store without a window crops exactly and decodes."""
    ids = random_ids(1, 24, seed=15)
    windowed = cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r4")
    with pytest.raises(ValueError, match="cache that can be cropped"):
        tiny_llama.generate(ids, cache=windowed, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False)
    plain = cache_for(tiny_llama, tiny_recipe, "nuq3-1%")
    out = tiny_llama.generate(ids, cache=plain, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == 32


def test_a_sliding_layer_refuses_a_crop_its_next_token_would_read_past():
    """A sliding layer of window 4 holding the last 3 of 6 tokens: cropped to 4 tokens, the next token (position
    4) reads positions 1-3, which were dropped."""
    from kvsqueeze.integrations.layers import Fp16Layer

    layer = Fp16Layer(window=4)
    kv = torch.randn(1, 2, 6, 8)
    layer.update(kv, kv)
    layer.slide()
    assert (layer.dropped, layer.get_seq_length()) == (3, 6)
    with pytest.raises(RuntimeError, match="cannot be cropped there"):
        layer.crop(-2)
    assert layer.get_seq_length() == 6


def test_serving_takes_a_window_with_its_key_slots(tiny_recipe_dir):
    """Pages serve a windowed method (the window in pages of its own, `serving.vllm.WindowStore`): its settings
    keep the window and give its keys the paged cache's fixed count of exact elements, as many for the recipe's
    channels as DEFAULT_KEY_SLOTS are for 1% of 192 (the tiny model's 32 channels: 1)."""
    from kvsqueeze.serving.settings import DEFAULT_KEY_SLOTS, ServingConfig, plain_key_slots

    spec = ServingConfig(recipe=str(tiny_recipe_dir), method="nuq3-1%:r16").spec
    assert spec.window == 16 and spec.key_slots == plain_key_slots(0.01, 32) == 1
    assert plain_key_slots(0.01, 192) == DEFAULT_KEY_SLOTS and plain_key_slots(0.01, 1024) == 32
    assert ServingConfig(recipe=str(tiny_recipe_dir), method="nuq3-1%:kslots3").spec.key_slots == 3


def test_serving_refuses_a_recipe_of_a_model_of_another_shape(tiny_recipe_dir):
    """The engine's model is compared with the recipe's fingerprint on every shape both know: layers, heads,
    key widths, the hidden width and the vocabulary."""
    import json

    from kvsqueeze.serving.settings import ServingConfig, ServingError

    fp = json.loads((tiny_recipe_dir / "recipe.json").read_text())["model"]["fingerprint"]
    config = ServingConfig(recipe=str(tiny_recipe_dir), method="nuq3-1%")
    same = dict(layers=fp["layers"], kv_heads=fp["kv_heads"], head_dim=fp["head_dim"], heads=fp["heads"],
                hidden_size=fp["hidden_size"], vocab_size=fp["vocab_size"])
    config.check_model(**same)
    for field in ("heads", "hidden_size", "vocab_size"):
        with pytest.raises(ServingError, match=f"{field} {fp[field]} in the recipe, {fp[field] + 8} in the model"):
            config.check_model(**{**same, field: fp[field] + 8})


def test_every_entry_point_defaults_to_the_3_5_bit_preset(tiny_recipe_dir, monkeypatch):
    """`generate` and `cache_for` (GenerateConfig), the lm-eval adapter and the vLLM plugin (with no
    KVSQUEEZE_METHOD) all start from the 3.5-bit preset: a per-channel budget with its 32-token fp16 window, which
    the paged cache accepts."""
    import inspect

    from kvsqueeze.config import GenerateConfig
    from kvsqueeze.integrations.cache import cache_for
    from kvsqueeze.integrations.harness import KVSqueezeLM
    from kvsqueeze.serving.settings import ServingConfig

    defaults = {GenerateConfig().method, inspect.signature(cache_for).parameters["method"].default,
                inspect.signature(KVSqueezeLM.__init__).parameters["method"].default}
    monkeypatch.setenv("KVSQUEEZE_RECIPE", str(tiny_recipe_dir))
    monkeypatch.delenv("KVSQUEEZE_METHOD", raising=False)
    served = ServingConfig.from_env()
    assert defaults == {served.method} == {"q3.5"}
    spec = served.spec
    assert (spec.budget, spec.budget_unit, spec.window, spec.context) == (3.5, "channel", 32, 2048)


def test_serving_a_budget_whose_layers_keep_different_key_outlier_shares(tiny_recipe_dir, monkeypatch, request):
    """The default key slots of a served budget are what its most outlier-rich layer pays for; a layer that paid
    for fewer holds fewer in its pages, not more than its budget paid for, and is served rather than refused
    (layers keeping 10% and 1% of the tiny model's 32 key channels exact: 4 and 1 slots)."""
    from kvsqueeze.methods import budget, family, parse_method
    from kvsqueeze.methods.budget import Choice
    from kvsqueeze.serving import settings
    from kvsqueeze.serving.settings import ServingConfig

    settings._layout.cache_clear()  # layouts built from the patched choices below must not outlive this test
    request.addfinalizer(settings._layout.cache_clear)
    shares = {0: 0.1, 1: 0.01}

    def choices(spec, recipe, layer):
        return Choice(3, shares[layer]), Choice(3, 0.0)

    import torch

    from kvsqueeze.recipe import Recipe

    monkeypatch.setattr(budget, "layer_choices", choices)
    monkeypatch.setattr(type(family(parse_method("nuq@3.5"))), "choices", lambda self, *a: choices(*a))
    monkeypatch.setattr(Recipe, "codebook", lambda *a: torch.linspace(-1, 1, 8))  # no 10% tables in the recipe
    monkeypatch.setattr(Recipe, "channel_range", lambda *a: (-torch.ones(32), torch.ones(32)))
    config = ServingConfig(recipe=str(tiny_recipe_dir), method="nuq@3.5:r32")
    assert config.spec.key_slots == 4  # ceil(10% of 32 channels)
    assert [config.layout(layer, 32, 16, 16).key_slots for layer in shares] == [4, 1]
    # the registry counts the bytes of the same slots: a page's data is what the registry says it holds
    spec, recipe = config.spec, config._recipe
    assert [family(spec).layouts(spec, recipe, layer)[0].slots for layer in shares] == [4, 1]


def test_a_crop_to_a_window_state_restores_the_tables_in_place(tiny_recipe):
    """`crop(tokens, state)` puts the sink and window tables back into the tensors the store holds, so a view's
    memo of them (the numba kernel's arrays) stays valid across a rollback, as across a decode step."""
    from kvsqueeze.cache.store import KVStore
    from kvsqueeze.methods import build_quantizers

    kq, vq = build_quantizers(parse_method("nuq3-1%"), tiny_recipe, 0, 32)
    store = KVStore(kq, vq, 32, 1, head_dim=16, window=4)
    store.append(torch.randn(1, 10, 32), torch.randn(1, 10, 32))
    state = store.window_state()
    tables = (store.sink_k, store.sink_v, store.sink_slot, store.sinks_taken, store.window_taken)
    before = [t.clone() for t in tables]
    store.append(torch.randn(1, 3, 32), torch.randn(1, 3, 32))
    store.crop(10, state)
    assert all(a is b for a, b in zip(tables, (store.sink_k, store.sink_v, store.sink_slot, store.sinks_taken,
                                               store.window_taken)))
    assert all(torch.equal(a, b) for a, b in zip(tables, before))


def test_a_presets_window_follows_the_tokens_the_models_layers_hold(tmp_path, monkeypatch):
    """On a model whose local layers keep 512 tokens (Gemma-3's), `q3.5` holds an 8-token fp16 window wherever it
    is named: `cache_for`, the lm-eval adapter's resolution and the vLLM plugin's settings (from the recipe's
    fingerprint) agree, and the cache holds the bits of that budget; on a model whose layers keep every token it
    stays 32."""
    import kvsqueeze
    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.integrations.preflight import model_windows
    from kvsqueeze.methods import preset_for
    from kvsqueeze.serving.settings import ServingConfig
    from test_families import GEMMA3, family_model

    model = family_model("gemma3", seed=3, **dict(GEMMA3, sliding_window=512))
    assert model_windows(model) == [512, None]
    acts = collect(model, random_ids(2, 64, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=2, seqlen=64), "tiny-gemma3", "random",
                        progress=False)
    cache = kvsqueeze.cache_for(model, recipe, "q3.5")
    assert cache.spec.name == "nuq@3.5:r8:chan"
    assert all(layer.store.window == 8 for layer in cache.layers)
    assert preset_for("q3.5", DEFAULT_CONTEXT, model_windows(model)) == cache.spec  # the adapter's resolution
    served = ServingConfig(recipe=str(recipe.save(tmp_path / "recipe")), method="q3.5").spec
    assert (served.budget, served.window, served.budget_unit) == (3.5, 8, "channel")
    with torch.no_grad():
        model(random_ids(1, DEFAULT_CONTEXT, seed=6), cache=cache, use_cache=True)
    bits = cache.memory_report().avg_bits  # at the context chosen for, the budget with that window holds its bits
    assert 3.0 < bits <= 3.5 * 1.02, bits
    assert kvsqueeze.cache_for(model, recipe, "nuq@3.5:r32:chan").spec.window == 32  # a name given is kept
