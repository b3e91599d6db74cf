"""numba's `dequantize_view` against the reference's: the same floats, bit for bit, through every outlier form,
code width and sink (pages read in place: `tests/paged/test_page_kernels.py`); the store reads through it on the
CPU; bad views are refused."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.kernels import api as kernels_api
from kvsqueeze.kernels import dequantize_view
from kvsqueeze.kernels import numba as numba_backend
from kvsqueeze.kernels.numba import dequant  # a numba that cannot load fails here, not silently
from kvsqueeze.kernels.reference import dequantize_view as reference

from test_decode import CASES, MIXED_CASES, make_mixed_store, make_store, outlier_variants, view_of


def assert_same(view) -> None:
    want = reference(view)
    got = dequant.dequantize_view(view)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-B{}-H{}-D{}-G{}-b{}-p{}-s{}".format(*c))
def test_equals_the_reference_bit_for_bit(case):
    tokens, batch, heads, head_dim, _, bits, fraction, sinks = case
    store = make_store(tokens, batch, heads, head_dim, bits, fraction, sinks, seed=tokens)
    assert_same(store.view())  # untrimmed: the store's allocations, rows past the tokens in use
    for variant in [view_of(store), *outlier_variants(view_of(store))]:
        assert_same(variant)


@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: "T{}-B{}-H{}-D{}-G{}-p{}-s{}".format(*c))
def test_channels_of_their_own_widths_equal_the_reference(case):
    tokens, batch, heads, head_dim, _, fraction, sinks = case
    store, _, _ = make_mixed_store(tokens, batch, heads, head_dim, fraction, sinks, seed=tokens)
    assert int(store.key_quantizer.widths.max()) > 4  # rows of 64 levels, codes straddling words
    assert_same(store.view())


def test_codes_under_outliers_and_padding_rows_are_replaced_as_the_reference_replaces_them():
    """Scrambled codes under every outlier (a cache built elsewhere) and padding tokens: what the reference
    gives, the outliers' exact values in place."""
    store = make_store(70, 3, 2, 64, 3, 0.05, 2, seed=5, real=torch.arange(70)[None, :] >= torch.tensor([[0], [9], [30]]))
    kv = view_of(store)
    g = torch.Generator().manual_seed(6)
    kv = kv._replace(**{name: torch.randint(-2**31, 2**31 - 1, getattr(kv, name).shape, generator=g,
                                            dtype=torch.int32) for name in ("k_codes", "v_codes")})
    assert kv.k_outliers.nnz and kv.v_outliers.nnz
    assert_same(kv)
    k, _ = dequant.dequantize_view(kv)
    ptr = kv.k_outliers.pointers.long()
    slot = int(torch.nonzero(ptr[1:] > ptr[:-1])[0])
    e = int(ptr[slot])
    t, b = divmod(slot, kv.batch)
    assert k[t, b, int(kv.k_outliers.channels[e])] == kv.k_outliers.values[e].float()


def test_the_store_reads_through_numba_on_the_cpu(monkeypatch):
    store = make_store(300, 2, 3, 64, 4, 0.01, 1, seed=3)
    calls = []
    fast = numba_backend.dequantize_view
    assert fast is dequant.dequantize_view
    monkeypatch.setattr(numba_backend, "dequantize_view", lambda kv: calls.append(kv.tokens) or fast(kv))
    kernels_api._dequantizer.cache_clear()
    try:
        got = store.dequantize()
        codes = store.dequantize_codes()
    finally:
        kernels_api._dequantizer.cache_clear()
    assert calls == [300, 300]
    for g, w in zip(got, reference(store.view())):
        assert torch.equal(g, w)
    view = store.view()
    s = store.sinks
    without_sinks = reference(view._replace(sink_k=view.sink_k[:, :s], sink_v=view.sink_v[:, :s],
                                            sink_slot=view.sink_slot[:, :s], memo={}))
    for g, w in zip(codes, without_sinks):
        assert torch.equal(g, w)


def test_an_empty_cache_gives_empty_tensors():
    store = make_store(5, 2, 2, 64, 3, 0.01, 1)
    store.crop(0)
    k, v = dequantize_view(store.view())
    assert k.shape == v.shape == (0, 2, 128)


def test_views_that_point_past_the_cache_are_refused():
    kv = view_of(make_store(40, 1, 2, 64, 3, 0.05, 1, seed=8))
    with pytest.raises(ValueError, match="sink at token 40 of a 40-token cache"):
        dequant.dequantize_view(kv._replace(sink_slot=torch.full_like(kv.sink_slot, 40)))
    chan = kv.v_outliers.channels.clone()
    chan[0] = 128
    with pytest.raises(ValueError, match="value outlier past channel 127"):
        dequant.dequantize_view(kv._replace(v_outliers=kv.v_outliers._replace(channels=chan)))
