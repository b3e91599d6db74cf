"""Tests for kvsqueeze.kernels: fused decode attention over the compressed cache.

Oracles, innermost first: the reference backend equals plain softmax attention
over what the cache layer itself reads back (`CompressedLayer.read()`, RoPE by the
model's rotary module); every other backend equals the reference across bit
widths, head widths, GQA ratios, batch, lengths, outliers and sinks; and
`generate()` through the fused path equals the dense path token for token.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
from dataclasses import replace
import torch

from kvsqueeze.cache.positions import PositionLog
from kvsqueeze.cache.store import KVStore
from kvsqueeze.numerics.datatypes import normal_float_levels, uniform_levels
from kvsqueeze.integrations.layers import CompressedLayer
from kvsqueeze.kernels import Backend, Rope, StoreView, available_backends, decode_attention, resolve_backend
from kvsqueeze.kernels import api as kernels_api
from kvsqueeze.numerics.quantizer import VectorQuantizer

# The fast backends are held to the reference; a fast backend that fails to import fails these tests instead of
# leaving them out, unless KVSQUEEZE_ALLOW_NO_NUMBA=1 says this machine is known to lack numba. The triton
# backend runs here under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 when there is no GPU).
NO_NUMBA = os.environ.get("KVSQUEEZE_ALLOW_NO_NUMBA") == "1"
FAST_BACKENDS = ([] if NO_NUMBA else [Backend.NUMBA]) + [Backend.TRITON]
# the interpreter runs every program in Python: the longest caches only through numba
COMPILED_BACKENDS = [b for b in FAST_BACKENDS if b is not Backend.TRITON]


def make_quantizers(sample_keys: torch.Tensor, bits: int, fraction: float, v_bits: int | None = None):
    """Per-channel key quantizer with thresholds from sample keys [N, C]; per-token value quantizer."""
    lo, hi = (torch.quantile(sample_keys[:4096], q, dim=0) for q in (fraction / 2, 1 - fraction / 2))
    return (VectorQuantizer(normal_float_levels(bits), "channel", fraction, lo=lo, hi=hi),
            VectorQuantizer(uniform_levels(v_bits or bits), "token", fraction))


def random_kv(batch: int, tokens: int, channels: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys whose channels have their own scale and offset (some all-positive), as real keys do; values."""
    scale = torch.rand(channels, generator=g) * 2 + 0.2
    offset = 2 * torch.randn(channels, generator=g)
    keys = torch.randn(batch, tokens, channels, generator=g) * scale + offset
    return keys, torch.randn(batch, tokens, channels, generator=g)


def make_store(tokens: int, batch: int, heads: int, head_dim: int, bits: int, fraction: float, sinks: int,
               v_bits: int | None = None, real: torch.Tensor | None = None, seed: int = 0,
               positions: torch.Tensor | None = None, log: PositionLog | None = None) -> KVStore:
    """A store of random tokens; positions int32 [T, B] (default: 0..T-1 in every row)."""
    c = heads * head_dim
    keys, values = random_kv(batch, tokens, c, torch.Generator().manual_seed(seed))
    store = KVStore(*make_quantizers(keys.reshape(-1, c), bits, fraction, v_bits), c, sinks, head_dim=head_dim,
                    positions=log)
    store.append(keys, values, real, None if positions is None else positions.t())
    return store


def own_widths(kq: VectorQuantizer, vq: VectorQuantizer, channels: int,
               g: torch.Generator) -> list[VectorQuantizer]:
    """The key and value quantizers with random widths of each channel's own (1 to 6 bits, `nuq@AVG:chan`)."""
    books = {w: uniform_levels(w) if w == 1 else normal_float_levels(w) for w in range(1, 7)}
    widths = [torch.randint(1, 7, (channels,), generator=g) for _ in (kq, vq)]
    return [replace(q, widths=w, codebooks=books, levels=books[int(w.max())]) for q, w in zip((kq, vq), widths)]


def make_mixed_store(tokens: int, batch: int, heads: int, head_dim: int, fraction: float, sinks: int,
                     seed: int = 0) -> tuple[KVStore, torch.Tensor, torch.Tensor]:
    """A store whose key and value channels have random widths of their own (1 to 6 bits), and its inputs."""
    c = heads * head_dim
    g = torch.Generator().manual_seed(seed)
    keys, values = random_kv(batch, tokens, c, g)
    mixed = own_widths(*make_quantizers(keys.reshape(-1, c), 4, fraction), c, g)
    store = KVStore(*mixed, c, sinks, head_dim=head_dim)
    store.append(keys, values)
    return store, keys, values


MIXED_CASES = [  # tokens, batch, kv heads, head_dim, G, outlier fraction, sinks
    (1, 1, 2, 64, 3, 0.01, 1),
    (17, 2, 3, 64, 7, 0.01, 2),
    (100, 1, 2, 128, 3, 0.0, 0),
    (130, 2, 2, 80, 3, 0.05, 5),
    (257, 1, 2, 16, 1, 0.02, 2),
]


@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: "T{}-B{}-H{}-D{}-G{}-p{}-s{}".format(*c))
def test_channels_of_their_own_widths_store_what_the_quantizer_gives_and_numba_reads_them(case):
    """Keys and values whose channels have widths of their own (`nuq@AVG:chan`): the store packs each code in
    its width and reads back exactly what the quantizer's own fake quantization gives; the numba and Triton
    kernels equal the reference over that cache, through their every outlier path."""
    tokens, batch, heads, head_dim, group, fraction, sinks = case
    store, keys, values = make_mixed_store(tokens, batch, heads, head_dim, fraction, sinks, seed=tokens)
    kv = view_of(store)
    widest = int(store.key_quantizer.widths.max())
    assert kv.k_offsets is not None and kv.k_levels.shape == (heads * head_dim, 2**widest) and widest > 4
    c = heads * head_dim
    k, v = store.dequantize()  # [T, B, C]
    for b in range(batch):
        for got, x, q in ((k, keys, store.key_quantizer), (v, values, store.value_quantizer)):
            want, _ = q.fake(x[b].float())
            torch.testing.assert_close(got[sinks:, b], want[sinks:], atol=0, rtol=0)
            torch.testing.assert_close(got[:sinks, b], x[b, :sinks].half().float(), atol=0, rtol=0)
    words = -(-int(store.key_quantizer.widths.sum()) // 32)
    assert store.k_codes.view().shape == (tokens, batch, words)  # each code in its own width, nothing wider
    assert store.component_bytes()["codes"] == (tokens * batch - min(sinks, tokens) * batch) * 4 * (
        words + -(-int(store.value_quantizer.widths.sum()) // 32))
    q = torch.randn(batch, heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    rope = Rope.default(head_dim)
    ref = decode_attention(q, kv, rope, head_dim**-0.5, backend=Backend.REFERENCE)
    for backend in FAST_BACKENDS if tokens <= 130 else COMPILED_BACKENDS:  # the interpreter: short caches
        torch.testing.assert_close(decode_attention(q, kv, rope, head_dim**-0.5, backend=backend), ref,
                                   atol=2e-5, rtol=1e-4)
        for variant in outlier_variants(kv):
            unknown = any(o is not None and o.code is None for o in (variant.k_outliers, variant.v_outliers))
            if unknown and backend is Backend.NUMBA:  # its sparse passes need the code under every outlier, which
                with pytest.raises(ValueError, match="code under every outlier"):  # a store always records
                    decode_attention(q, variant, rope, head_dim**-0.5, backend=backend)
                continue
            torch.testing.assert_close(decode_attention(q, variant, rope, head_dim**-0.5, backend=backend), ref,
                                       atol=2e-5, rtol=1e-4)


def view_of(store: KVStore) -> StoreView:
    """The store's view cut to the rows in use (what tests edit field by field)."""
    return store.view().trim()


def positions_for(tokens: int, batch: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [T, B]: generate()'s convention, each row counting from its first real token (padding at 1)."""
    if real is None:
        return torch.arange(tokens, dtype=torch.int32).view(-1, 1).expand(tokens, batch).contiguous()
    pos = (real.long().cumsum(dim=1) - 1).masked_fill(~real, 1)
    return pos.t().to(torch.int32).contiguous()


CASES = [  # tokens, batch, kv heads, head_dim, G (query heads per KV head), bits, outlier fraction, sinks
    (1, 1, 2, 64, 3, 3, 0.01, 1),  # a single token, which is a sink
    (1, 2, 1, 128, 1, 4, 0.0, 0),
    (17, 1, 2, 64, 3, 2, 0.01, 0),
    (17, 2, 3, 64, 7, 3, 0.01, 2),
    (17, 2, 1, 256, 1, 4, 0.0, 1),
    (100, 1, 2, 128, 3, 3, 0.05, 0),
    (130, 2, 2, 256, 7, 2, 0.01, 5),
    (300, 2, 3, 64, 1, 4, 0.01, 1),
    (257, 1, 2, 16, 3, 3, 0.02, 2),  # head_dim 16: heads do not start on a word boundary at 3 bits
    (90, 2, 3, 80, 3, 3, 0.02, 1),  # head_dim 80: 7.5 words a head, codes straddling at the heads' ends
    (64, 1, 2, 64, 2, 2, 0.0, 1),  # exactly one block of tokens
    (70, 2, 2, 64, 4, 5, 0.01, 1),  # wider than the 16-entry lookup: 5 to 8 bits
    (65, 1, 2, 32, 2, 6, 0.0, 0),
    (40, 1, 1, 96, 8, 8, 0.01, 1),
]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-B{}-H{}-D{}-G{}-b{}-p{}-s{}".format(*c))
def test_backend_equals_reference(backend, case):
    tokens, batch, heads, head_dim, group, bits, fraction, sinks = case
    store = make_store(tokens, batch, heads, head_dim, bits, fraction, sinks, seed=tokens)
    kv = view_of(store)
    q = torch.randn(batch, heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    rope = Rope.default(head_dim)
    ref = decode_attention(q, kv, rope, head_dim**-0.5, backend=Backend.REFERENCE)
    got = decode_attention(q, kv, rope, head_dim**-0.5, backend=backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    for variant in outlier_variants(kv):  # the same cache through the backend's other outlier paths
        unknown = any(s is not None and s.nnz and s.code is None for s in (variant.k_outliers, variant.v_outliers))
        if backend is Backend.NUMBA and bits > 4 and unknown:  # numba reads codes wider than 4 bits by offsets
            with pytest.raises(ValueError, match="codes wider than 4 bits need the code under every outlier"):
                decode_attention(q, variant, rope, head_dim**-0.5, backend=backend)
            continue
        got = decode_attention(q, variant, rope, head_dim**-0.5, backend=backend)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


WINDOW_CASES = [  # tokens, batch, kv heads, head_dim, G, bits (0: each channel its own), fraction, sinks, window
    (70, 2, 2, 64, 3, 3, 0.01, 1, 8),
    (45, 1, 3, 80, 2, 0, 0.02, 0, 32),  # head_dim 80: 40 rotary pairs, the last lanes of a vector unused
    (300, 2, 2, 64, 3, 0, 0.01, 2, 32),
    (20, 1, 1, 16, 4, 4, 0.05, 1, 32),  # a window longer than the cache: every token but the sink exact
]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "T{}-B{}-H{}-D{}-G{}-b{}-p{}-s{}-w{}".format(*c))
def test_backend_equals_reference_with_an_fp16_window(backend, case):
    """A method's fp16 window (`:rN`): its tokens' exact copies enter the kernels as sink entries, whose scores
    and values the sink passes put in place of the quantized ones (16 pairs or channels a vector), over value
    outliers of fixed counts or per-slot pointers, codes of one width or of each channel's own."""
    tokens, batch, heads, head_dim, group, bits, fraction, sinks, window = case
    c = heads * head_dim
    g = torch.Generator().manual_seed(tokens)
    keys, values = random_kv(batch, tokens, c, g)
    kq, vq = make_quantizers(keys.reshape(-1, c), bits or 4, fraction)
    if not bits:
        kq, vq = own_widths(kq, vq, c, g)
    store = KVStore(kq, vq, c, sinks, head_dim=head_dim, window=window)
    store.append(keys[:, : tokens // 2], values[:, : tokens // 2])
    store.append(keys[:, tokens // 2:], values[:, tokens // 2:])  # the window's ring written across two appends
    kv = view_of(store)
    assert int((kv.sink_slot >= 0).sum()) == batch * min(tokens, sinks + window)
    q = torch.randn(batch, heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    rope = Rope.default(head_dim)
    ref = decode_attention(q, kv, rope, head_dim**-0.5, backend=Backend.REFERENCE)
    for variant in [kv, *outlier_variants(kv)]:
        if backend is Backend.NUMBA and variant.v_offsets is not None and any(
                s is not None and s.nnz and s.code is None for s in (variant.k_outliers, variant.v_outliers)):
            continue  # channels of their own widths need the code under every outlier (refused, tested above)
        got = decode_attention(q, variant, rope, head_dim**-0.5, backend=backend)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def outlier_variants(kv: StoreView) -> list[StoreView]:
    """kv with its outliers described less precisely: value outliers as general CSR (counts per slot not known
    to be equal), and codes under the outliers not known (the backend must read them), alone and together."""
    k, v = kv.k_outliers, kv.v_outliers
    assert all(s.code == KVStore.OUTLIER_CODE for s in (k, v) if s is not None)
    unknown = {"k_outliers": k and k._replace(code=None), "v_outliers": v and v._replace(code=None)}
    if v is None or not v.nnz:
        return [kv._replace(**unknown)] if k is not None and k.nnz else []
    assert v.fixed
    counted = v._replace(fixed=None)
    return [kv._replace(v_outliers=counted), kv._replace(**unknown),
            kv._replace(k_outliers=unknown["k_outliers"], v_outliers=counted._replace(code=None))]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("fixed", [True, False])
def test_backend_reads_the_codes_under_outliers_when_they_are_not_known(backend, fixed):
    """Codes under outliers are any codes (a cache built elsewhere): with `code=None` the backend must read them."""
    tokens, batch, heads, head_dim = 70, 2, 2, 64
    store = make_store(tokens, batch, heads, head_dim, 3, 0.05, 1, seed=11)
    kv = view_of(store)
    g = torch.Generator().manual_seed(12)
    scrambled = {name: torch.randint(-2**31, 2**31 - 1, getattr(kv, name).shape, generator=g, dtype=torch.int32)
                 for name in ("k_codes", "v_codes")}
    kv = kv._replace(**scrambled, k_outliers=kv.k_outliers._replace(code=None),
                             v_outliers=kv.v_outliers._replace(code=None, fixed=kv.v_outliers.fixed if fixed else None))
    q = torch.randn(batch, heads * 3, head_dim, generator=g)
    rope = Rope.default(head_dim)
    ref = decode_attention(q, kv, rope, 0.125, backend=Backend.REFERENCE)
    torch.testing.assert_close(decode_attention(q, kv, rope, 0.125, backend=backend), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", FAST_BACKENDS)  # the reference trims every view first: nothing to compare
@pytest.mark.parametrize("case", CASES[1::2], ids=lambda c: "T{}-B{}-H{}-D{}-G{}-b{}-p{}-s{}".format(*c))
def test_store_view_equals_its_trimmed_view(backend, case):
    """`KVStore.view()` (the store's allocations, positions from a longer shared log) computes exactly what the
    view cut to the rows in use computes, and keeps doing so as the store grows and reallocates."""
    tokens, batch, heads, head_dim, group, bits, fraction, sinks = case
    log = PositionLog()
    log.write(0, positions_for(tokens + 3, batch).t())  # rows past the store's tokens must be ignored
    store = make_store(tokens, batch, heads, head_dim, bits, fraction, sinks, seed=tokens,
                       positions=positions_for(tokens, batch), log=log)
    assert len(log) == tokens + 3
    q = torch.randn(batch, heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    rope = Rope.default(head_dim)
    mask = torch.rand(batch, tokens + 2, generator=torch.Generator().manual_seed(2)) > 0.2
    mask[:, -1] = True
    for step in range(3):  # appends reallocate some buffers and not others
        t = store.tokens
        want = decode_attention(q, view_of(store), rope, 0.125, key_mask=mask[:, :t], backend=backend)
        got = decode_attention(q, store.view(), rope, 0.125, key_mask=mask[:, :t], backend=backend)
        assert torch.equal(got, want)
        store.append(*random_kv(batch, 1, heads * head_dim, torch.Generator().manual_seed(50 + step)))


def test_store_view_explains_bad_inputs_like_the_trimmed_view():
    store = make_store(5, 1, 2, 16, 4, 0.01, 0)
    rope = Rope.default(16)
    for backend in available_backends("cpu"):
        for kv in (store.view(), view_of(store)):
            with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
                decode_attention(torch.zeros(1, 3, 16), kv, rope, 1.0, backend=backend)
            with pytest.raises(ValueError, match="positions must be"):
                decode_attention(torch.zeros(1, 4, 16), kv._replace(positions=positions_for(4, 1)), rope, 1.0,
                                 backend=backend)
            with pytest.raises(ValueError, match="key_mask must be bool"):
                decode_attention(torch.zeros(1, 4, 16), kv, rope, 1.0, key_mask=torch.ones(1, 4, dtype=torch.bool),
                                 backend=backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_follows_quantizer_tensors_changed_in_place(backend):
    """Backends may keep tables derived from a layer's scales between calls; changing them must be seen."""
    store = make_store(40, 1, 2, 64, 3, 0.01, 1, seed=5)
    kv = view_of(store)
    q = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3))
    rope = Rope.default(64)
    before = decode_attention(q, kv, rope, 0.125, backend=backend)
    kv.k_scale.mul_(1.5)
    kv.k_zero.add_(0.25)
    ref = decode_attention(q, kv, rope, 0.125, backend=Backend.REFERENCE)
    got = decode_attention(q, kv, rope, 0.125, backend=backend)
    assert not torch.allclose(before, got, atol=1e-4)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_runs_on_a_cache_built_in_inference_mode(backend):
    with torch.inference_mode():
        store = make_store(33, 1, 2, 64, 3, 0.01, 1, seed=6)
        kv = view_of(store)
        q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(4))
        rope = Rope.default(64)
        ref = decode_attention(q, kv, rope, 0.125, backend=Backend.REFERENCE)
        got = decode_attention(q, kv, rope, 0.125, backend=backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # and outside it, on the same inference tensors
        torch.testing.assert_close(decode_attention(q, kv, rope, 0.125, backend=backend), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_equals_reference_mixed_bits_padding_and_long_positions(backend):
    batch, tokens, heads, head_dim = 2, 150, 2, 64
    real = torch.ones(batch, tokens, dtype=torch.bool)
    real[1, :37] = False  # left padding: not sinks, masked, positions restart after it
    pos = positions_for(tokens, batch, real) + 70_000  # past the first table rows
    store = make_store(tokens, batch, heads, head_dim, 4, 0.01, 2, v_bits=2, real=real, positions=pos)
    kv = store.view()
    q = torch.randn(batch, heads * 3, head_dim, generator=torch.Generator().manual_seed(2))
    rope = Rope(Rope.default(head_dim, theta=500_000.0).inv_freq, scaling=1.2)
    ref = decode_attention(q, kv, rope, 0.1, key_mask=real, backend=Backend.REFERENCE)
    got = decode_attention(q, kv, rope, 0.1, key_mask=real, backend=backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_backend_equals_reference_beyond_65536_tokens(backend):
    tokens, heads, head_dim = 65_600, 1, 64
    store = make_store(tokens, 1, heads, head_dim, 3, 0.01, 1)
    kv = view_of(store)
    q = torch.randn(1, 3, head_dim, generator=torch.Generator().manual_seed(3)) * 3  # peaked attention
    rope = Rope.default(head_dim)
    ref = decode_attention(q, kv, rope, head_dim**-0.5, backend=Backend.REFERENCE)
    got = decode_attention(q, kv, rope, head_dim**-0.5, backend=backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("rotary", [8, 32, 0])
def test_backend_equals_reference_when_rope_turns_part_of_each_head(backend, rotary):
    """Partial rotary (Phi, StableLM: the first R channels turn in pairs (j, j + R/2), the rest pass) and no
    rotation at all (NoPE layers, `Rope.identity`), with outliers, sinks and padding restarting positions."""
    batch, tokens, heads, head_dim = 2, 150, 2, 64
    real = torch.ones(batch, tokens, dtype=torch.bool)
    real[1, :37] = False
    store = make_store(tokens, batch, heads, head_dim, 3, 0.02, 2, real=real,
                       positions=positions_for(tokens, batch, real))
    kv = store.view()
    q = torch.randn(batch, heads * 3, head_dim, generator=torch.Generator().manual_seed(7))
    rope = Rope.default(rotary, theta=100.0) if rotary else Rope.identity(head_dim)
    ref = decode_attention(q, kv, rope, 0.125, key_mask=real, backend=Backend.REFERENCE)
    got = decode_attention(q, kv, rope, 0.125, key_mask=real, backend=backend)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    full = decode_attention(q, kv, Rope.default(head_dim, theta=100.0), 0.125, key_mask=real, backend=backend)
    assert (full - got).abs().max() > 1e-3  # the channels past R really are left alone


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_softcap_and_sink_logits_equal_the_reference_and_the_formula(backend):
    """Soft-capped logits (Gemma-2) and a learned logit per query head with no value (GPT-OSS), as the models'
    own eager attention computes them: cap, mask, then softmax over the tokens and the sink logit."""
    from kvsqueeze.kernels.reference import dequantize_view

    batch, tokens, heads, head_dim, group = 2, 130, 2, 16, 3
    real = torch.ones(batch, tokens, dtype=torch.bool)
    real[1, :11] = False
    store = make_store(tokens, batch, heads, head_dim, 3, 0.01, 1, real=real,
                       positions=positions_for(tokens, batch, real))
    kv = store.view()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(batch, heads * group, head_dim, generator=g) * 4  # logits past the cap
    sinks = torch.randn(heads * group, generator=g) * 3
    rope = Rope.default(head_dim)
    cap, scaling = 3.0, head_dim**-0.5
    got = decode_attention(q, kv, rope, scaling, real, backend, softcap=cap, sink_logits=sinks)
    ref = decode_attention(q, kv, rope, scaling, real, Backend.REFERENCE, softcap=cap, sink_logits=sinks)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    k, v = dequantize_view(kv)  # [T, B, C]
    k = rope.apply(k.view(tokens, batch, heads, head_dim).permute(1, 2, 0, 3), kv.positions[:tokens].t()[:, None])
    v = v.view(tokens, batch, heads, head_dim).permute(1, 2, 0, 3)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, Hq, T, D]
    logits = cap * torch.tanh(torch.einsum("bhd,bhtd->bht", q, k) * scaling / cap)
    logits = torch.cat([logits.masked_fill(~real[:, None], float("-inf")), sinks.view(1, -1, 1).expand(batch, -1, 1)],
                       dim=-1)
    want = torch.einsum("bht,bhtd->bhd", logits.softmax(-1)[..., :-1], v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    plain = decode_attention(q, kv, rope, scaling, real, backend)
    assert (plain - got).abs().max() > 1e-2  # the options change the result: they are not dropped
    with pytest.raises(ValueError, match="one logit per query head"):
        decode_attention(q, kv, rope, scaling, real, backend, sink_logits=sinks[:2])


def test_reference_equals_attention_over_the_layer_read(tiny_llama):
    """RoPE from the model's rotary module, dequantization by the store: the reference must agree."""
    from kvsqueeze.integrations.parts import layer_rotaries

    heads, head_dim, group, batch, tokens = 2, 16, 2, 2, 90
    c = heads * head_dim
    g = torch.Generator().manual_seed(4)
    keys, values = random_kv(batch, tokens, c, g)
    store = KVStore(*make_quantizers(keys.reshape(-1, c), 3, 0.01), c, sinks=2, head_dim=head_dim)
    rotary = layer_rotaries(tiny_llama, head_dim)[0]
    layer = CompressedLayer(store, 0, rotary)
    for start, stop in ((0, 60), (60, 61), (61, tokens)):  # a prefill, a decode step, more tokens
        layer.append_pre_rope(keys[:, start:stop], values[:, start:stop],
                              torch.arange(start, stop).expand(batch, stop - start))
    k, v = layer.read(torch.float32)  # [B, H, T, D], RoPE applied by the model's rotary module
    q = torch.randn(batch, heads * group, head_dim, generator=g)
    scores = torch.einsum("bhgd,bhtd->bhgt", q.view(batch, heads, group, head_dim), k) * 0.25
    expected = torch.einsum("bhgt,bhtd->bhgd", scores.softmax(-1), v).reshape(batch, heads * group, head_dim)
    kv = store.view()
    got = decode_attention(q, kv, rotary.rope, 0.25, backend=Backend.REFERENCE)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


# ---- the backend choice ---------------------------------------------------------------------------
def test_the_triton_backend_loads_and_auto_keeps_numba_for_cpu_tensors():
    assert resolve_backend("triton", "cpu") is Backend.TRITON  # under the interpreter; its import error fails here
    assert resolve_backend("triton", "cuda") is Backend.TRITON
    assert resolve_backend("auto", "cuda") is Backend.TRITON  # numba does not run on CUDA tensors
    if not NO_NUMBA:
        assert resolve_backend("auto", "cpu") is Backend.NUMBA


def test_the_triton_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    from kvsqueeze.kernels.triton import attend

    monkeypatch.delenv("TRITON_INTERPRET")
    for f in (kernels_api._load, kernels_api._entry):
        f.cache_clear()
    try:
        with pytest.raises(ValueError, match="cannot run on cpu"):
            resolve_backend("triton", "cpu")
        kv = view_of(make_store(3, 1, 1, 16, 3, 0.0, 0))
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            attend.decode_attention(torch.randn(1, 1, 16), kv, Rope.default(16), 0.25, None)
    finally:
        monkeypatch.undo()
        for f in (kernels_api._load, kernels_api._entry):
            f.cache_clear()


@pytest.mark.skipif(NO_NUMBA, reason="KVSQUEEZE_ALLOW_NO_NUMBA=1: this machine is known to lack numba")
def test_the_numba_backend_loads():
    assert resolve_backend("numba", "cpu") is Backend.NUMBA  # its real import error, if any, fails this test
    assert available_backends("cpu")[0] is Backend.NUMBA and resolve_backend("auto", "cpu") is Backend.NUMBA


def test_a_backend_that_cannot_load_raises_by_name_and_auto_warns_once(monkeypatch):
    def clear():
        for f in (kernels_api._load, kernels_api._entry, kernels_api._warn_fallback):
            f.cache_clear()

    monkeypatch.setitem(kernels_api._MODULES, Backend.NUMBA, ".no_such_backend")
    clear()
    try:
        with pytest.raises(ImportError, match="no_such_backend"):
            resolve_backend("numba", "cpu")
        with pytest.warns(RuntimeWarning, match="numba decode backend cannot be loaded"):
            assert resolve_backend("auto", "cpu") is Backend.REFERENCE
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert resolve_backend("auto", "cpu") is Backend.REFERENCE  # once
        assert available_backends("cpu") == [Backend.REFERENCE]
    finally:
        monkeypatch.undo()
        clear()


def test_backends_are_explicit():
    assert Backend.REFERENCE in available_backends("cpu")
    assert available_backends("cpu")[-1] is Backend.REFERENCE  # fastest first, the reference last
    assert resolve_backend("auto", "cpu") is available_backends("cpu")[0]
    assert resolve_backend("auto", "meta") is Backend.REFERENCE  # only the reference runs off the CPU
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda-magic")
    if Backend.NUMBA in available_backends("cpu"):
        with pytest.raises(ValueError, match="cannot run on meta"):
            resolve_backend("numba", "meta")


def test_bad_inputs_are_explained():
    store = make_store(5, 1, 2, 16, 4, 0.0, 0)
    kv = view_of(store)
    rope = Rope.default(16)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        decode_attention(torch.zeros(1, 3, 16), kv, rope, 1.0)
    with pytest.raises(ValueError, match="q must be float32"):
        decode_attention(torch.zeros(1, 4, 16, dtype=torch.float16), kv, rope, 1.0)
    with pytest.raises(ValueError, match="key_mask must be bool"):
        decode_attention(torch.zeros(1, 4, 16), kv, rope, 1.0, key_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="RoPE frequencies turn 32 channels, the heads have 16"):
        decode_attention(torch.zeros(1, 4, 16), kv, Rope.default(32), 1.0)  # a table read past its end otherwise



@pytest.mark.skipif(NO_NUMBA, reason="KVSQUEEZE_ALLOW_NO_NUMBA=1: this machine is known to lack numba")
def test_the_numba_backend_refuses_a_sink_past_the_cache():
    """A hand-made view whose sink names a token past the cache: the sink passes would write that token's score
    past the end of the scores."""
    store = make_store(5, 1, 2, 16, 4, 0.01, 1)
    kv = view_of(store)
    rope = Rope.default(16)
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(decode_attention(q, kv, rope, 0.25, backend="numba"),
                          decode_attention(q, kv, rope, 0.25, backend="reference"), atol=1e-5)
    with pytest.raises(ValueError, match="sink names token 5 of a cache of 5 tokens"):
        decode_attention(q, kv._replace(sink_slot=torch.full_like(kv.sink_slot, 5)), rope, 0.25, backend="numba")

# ---- generate() through the fused path ------------------------------------------------------------
def _counting(monkeypatch):
    """Count the kernel calls the fused path makes."""
    from kvsqueeze.integrations import fused

    calls = []
    real = fused.decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "decode_attention", counted)
    return calls


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq2-1%:sink3", "nuq4", "nuq@3:chan", "nuq@2.4:chan:sink3"])
def test_generate_fused_equals_dense_path(tiny_llama, tiny_recipe, method, monkeypatch):
    from conftest import LAYERS, random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode

    ids = random_ids(2, 14, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the fused kernel must mask it like SDPA does
    new = 24
    kw = {"attention_mask": mask, "max_new_tokens": new, "min_new_tokens": new, "do_sample": False,
          "pad_token_id": 0}
    with torch.inference_mode():  # as serving code often runs (no version counters on the cache's tensors)
        dense_cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, method)
        expected = tiny_llama.generate(ids, cache=dense_cache, **kw)
        cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, method)
        calls = _counting(monkeypatch)
        with fused_decode(tiny_llama, cache) as handle:
            assert all(layer.decode_backend is handle.backend for layer in cache.layers)
            got = tiny_llama.generate(ids, cache=cache, **kw)
    assert torch.equal(got, expected)
    assert len(calls) == LAYERS * (new - 1)  # every decode step of every layer, never the prefill
    assert handle.closed and tiny_llama.config._attn_implementation == "sdpa"
    assert all(isinstance(layer, CompressedLayer) and layer.decode_backend is None for layer in cache.layers)


def test_generate_through_the_triton_backend_equals_the_dense_path(tiny_llama, tiny_recipe):
    """generate() with the Triton kernels as the decode backend (under the interpreter here), left padding and
    sinks: the same tokens as the dense path."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode

    ids = random_ids(2, 10, seed=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = tiny_llama.generate(ids, cache=kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%"), **kw)
        cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%")
        with fused_decode(tiny_llama, cache, "triton") as handle:
            assert handle.backend is Backend.TRITON
            got = tiny_llama.generate(ids, cache=cache, **kw)
    assert torch.equal(got, expected)


def _step_logits(model, cache, ids, start: int, stop: int, prefill: bool = False) -> list[torch.Tensor]:
    """Last-position logits: of ids[:, :start] in one forward (when `prefill`), then of each token start..stop-1."""
    out = [model(ids[:, :start], cache=cache, use_cache=True).logits[:, -1]] if prefill else []
    return out + [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(start, stop)]


def test_fused_decode_logits_match_dense_step_by_step(tiny_llama, tiny_recipe):
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import enable_fused_decode

    ids = random_ids(1, 40, seed=9)
    with torch.no_grad():
        dense, fused = (kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%") for _ in range(2))
        expected = _step_logits(tiny_llama, dense, ids, 20, 40, prefill=True)
        handle = enable_fused_decode(tiny_llama, fused, "reference")
        try:
            got = _step_logits(tiny_llama, fused, ids, 20, 40, prefill=True)
        finally:
            handle.close()
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not FAST_BACKENDS, reason="no fast backend on this machine")
def test_deep_copy_of_a_cache_decodes_like_the_original(tiny_llama, tiny_recipe):
    """Prompt reuse (deepcopy a filled cache, decode from the copy) after the fast kernel read the original."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import enable_fused_decode

    ids = random_ids(1, 40, seed=11)
    with torch.no_grad():
        dense, fused = (kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%") for _ in range(2))
        expected = _step_logits(tiny_llama, dense, ids, 20, 40, prefill=True)
        with enable_fused_decode(tiny_llama, fused, FAST_BACKENDS[0]):
            got = _step_logits(tiny_llama, fused, ids, 20, 30, prefill=True)
        dup = copy.deepcopy(fused)  # 30 tokens in buffers of 32 rows: the copy's next appends need no reallocation
        with enable_fused_decode(tiny_llama, dup, FAST_BACKENDS[0]):
            got += _step_logits(tiny_llama, dup, ids, 30, 40)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-4, rtol=1e-4)


def test_fused_decode_follows_beam_reordering_and_crops(tiny_llama, tiny_recipe):
    """Beam search reorders the cache's rows between steps; a crop truncates it (speculative decoding)."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode

    model = tiny_llama
    ids = random_ids(2, 12, seed=3)
    kw = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False, "num_beams": 3, "pad_token_id": 0}
    long = random_ids(1, 40, seed=5)
    with torch.no_grad():
        expected = model.generate(ids, cache=kvsqueeze.cache_for(model, tiny_recipe, "nuq3-1%"), **kw)
        dense = kvsqueeze.cache_for(model, tiny_recipe, "nuq3-1%")
        steps = _step_logits(model, dense, long, 20, 30, prefill=True)[1:]
        cache, cropped = (kvsqueeze.cache_for(model, tiny_recipe, "nuq3-1%") for _ in range(2))
        with fused_decode(model, cache):
            got = model.generate(ids, cache=cache, **kw)
        with fused_decode(model, cropped):
            _step_logits(model, cropped, long, 20, 36, prefill=True)
            cropped.crop(-16)  # back to the prompt: the steps after it must not see the dropped tokens
            again = _step_logits(model, cropped, long, 20, 30)
    assert torch.equal(got, expected)
    torch.testing.assert_close(torch.stack(again), torch.stack(steps), atol=1e-4, rtol=1e-4)


def test_fused_decode_needs_a_compressed_cache(tiny_llama, tiny_recipe):
    import kvsqueeze
    from kvsqueeze.integrations.fused import enable_fused_decode

    with pytest.raises(ValueError, match="compressed store"):
        enable_fused_decode(tiny_llama, kvsqueeze.cache_for(tiny_llama, tiny_recipe, "fp16"))
    with pytest.raises(ValueError, match="unknown backend"):
        enable_fused_decode(tiny_llama, kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%"), "gpu-magic")
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_a_fused_step_refuses_a_model_whose_attention_cannot_read_it(tiny_llama, tiny_recipe):
    """Two fused caches on one model, the first closed before the second: the model runs SDPA again, which
    would read the second cache's decode marker as a cache of no tokens. Its next step refuses."""
    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import enable_fused_decode

    ids = random_ids(1, 24, seed=4)
    first, second = (kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%") for _ in range(2))
    with torch.no_grad():
        h1 = enable_fused_decode(tiny_llama, first, "reference")
        h2 = enable_fused_decode(tiny_llama, second, "reference")
        try:
            _step_logits(tiny_llama, second, ids, 20, 22, prefill=True)
            h1.close()
            assert tiny_llama.config._attn_implementation == "sdpa"
            with pytest.raises(RuntimeError, match="fused decode is on for this cache"):
                _step_logits(tiny_llama, second, ids, 22, 23)
        finally:
            h2.close()  # it restores the attention it found, kvsqueeze's (harmless without kvsqueeze state)
            h1.close()
            tiny_llama.set_attn_implementation("sdpa")  # the module's model, as the other tests expect it


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_refuses_more_scores_than_it_addresses(backend):
    """2**31 scores in one call (rows x query heads x tokens) would overflow the kernel's 32-bit lane offsets:
    a clear error naming the way out, before anything is read (the long tensors are stride-0 views)."""
    store = make_store(2, 1, 1, 64, 3, 0.0, 0)
    kv = view_of(store)
    tokens = (1 << 31) // 8 + 1
    long = {name: getattr(kv, name)[:1].expand(tokens, *getattr(kv, name).shape[1:])
            for name in ("k_codes", "v_codes", "v_scale_zero", "positions")}
    kv = kv._replace(**long, tokens=tokens)
    q = torch.randn(1, 8, 64)
    with pytest.raises(ValueError, match=r"2\*\*31 scores.*backend='reference'"):
        decode_attention(q, kv, Rope.default(64), 0.125, backend=backend)


def test_a_fused_decode_step_reaches_the_backend_in_few_calls(tiny_llama, tiny_recipe, monkeypatch):
    """From the attention function to the backend's entry point: at most four calls (the hot path is
    readable in one sitting: kvsqueeze_attention -> fused_attention -> decode_attention -> the backend)."""
    import inspect

    from conftest import random_ids

    import kvsqueeze
    from kvsqueeze.integrations.fused import fused_decode
    from kvsqueeze.kernels import reference

    depths = []
    real = reference.decode_attention

    def entry(*args):
        names = [f.function for f in inspect.stack()]
        depths.append(names.index("kvsqueeze_attention"))  # frames from here up to the attention function
        return real(*args)

    for f in (kernels_api._load, kernels_api._entry):
        f.cache_clear()
    monkeypatch.setattr(reference, "decode_attention", entry)
    try:
        with torch.no_grad():
            cache = kvsqueeze.cache_for(tiny_llama, tiny_recipe, "nuq3-1%")
            with fused_decode(tiny_llama, cache, "reference"):
                tiny_llama.generate(random_ids(1, 8, seed=1), cache=cache, max_new_tokens=3, min_new_tokens=3,
                                    do_sample=False, pad_token_id=0)
    finally:
        monkeypatch.undo()
        for f in (kernels_api._load, kernels_api._entry):
            f.cache_clear()
    assert depths and max(depths) <= 4, depths


def test_the_first_triton_result_of_each_variant_on_a_gpu_is_held_to_the_reference(monkeypatch):
    """On a GPU (simulated here by KVSQUEEZE_CHECK_TRITON=1) a kernel that computes something else raises on its
    first call instead of decoding with wrong numbers; a variant that passed is not checked again."""
    from kvsqueeze.kernels.triton import attend

    kv = view_of(make_store(20, 1, 2, 16, 3, 0.05, 1))
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(5))
    rope = Rope.default(16)
    monkeypatch.setenv("KVSQUEEZE_CHECK_TRITON", "1")
    monkeypatch.setattr(attend, "_CHECKED", set())
    real = attend._decode
    monkeypatch.setattr(attend, "_decode", lambda *a: real(*a) * 1.001)
    with pytest.raises(RuntimeError, match="differ from the reference"):
        attend.decode_attention(q, kv, rope, 0.25, None)
    monkeypatch.setattr(attend, "_decode", real)
    good = attend.decode_attention(q, kv, rope, 0.25, None)
    assert len(attend._CHECKED) == 1
    calls = []
    monkeypatch.setattr(attend, "_check_first", lambda *a: calls.append(a))
    torch.testing.assert_close(attend.decode_attention(q, kv, rope, 0.25, None), good)
    assert not calls  # checked once per variant


def test_the_first_triton_check_takes_a_fully_masked_row_as_equal(monkeypatch):
    """A row whose every key is masked is NaN in the reference and the kernels alike (a softmax over nothing):
    the first-call check once raised there, blaming the kernels."""
    from kvsqueeze.kernels.triton import attend

    kv = view_of(make_store(20, 2, 1, 32, 3, 0.0, 0))
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1] = False
    monkeypatch.setenv("KVSQUEEZE_CHECK_TRITON", "1")
    monkeypatch.setattr(attend, "_CHECKED", set())
    out = attend.decode_attention(q, kv, Rope.default(32), 0.2, mask)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and len(attend._CHECKED) == 1


# ---- the Triton programs compiled for a GPU, without one ------------------------------------------------
# The interpreter runs the programs as Python, so it never types them as the GPU compiler does: a program that
# returns int64 on one path and int32 on another passes every interpreted test and is refused on the first GPU.
# So every program the backend launches is compiled for an sm_90 GPU here (Triton's front end, LLVM and its
# bundled ptxas need no GPU), with the argument types and constants of the launches the cases below make.
TL_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
            torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}

COMPILE_FOR_GPU = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvsqueeze.kernels.triton import attend, encode, passes

gpu_sizes = {"BLOCK_T": attend.BLOCK_T, "BLOCK": attend.SPARSE_BLOCK}  # the interpreter's larger blocks, undone
failed = []
for module, name, types, consts in json.load(open(sys.argv[1])):
    fn = getattr({"passes": passes, "encode": encode}[module], name)
    consts = {k: gpu_sizes.get(k, v) if module == "passes" else v for k, v in consts}
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    signature = dict(zip(fn.arg_names, types))
    signature.update({k: "constexpr" for k in consts})
    assert set(signature) == set(fn.arg_names) and set(consts) == constexpr, (name, signature, consts)
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # every failure is reported, not only the first
        failed.append(f"{name} {types} {consts}: {type(exc).__name__}: {str(exc)[-600:]}")
print(json.dumps(failed))
'''


def _tl_type(x) -> str:
    if isinstance(x, torch.Tensor):
        return "*" + TL_TYPES[x.dtype]
    if isinstance(x, bool):
        return "i1"
    if isinstance(x, int):
        return "i32" if -2**31 <= x < 2**31 else "i64"
    if isinstance(x, float):
        return "fp32"
    raise TypeError(f"a launch argument of type {type(x).__name__}")


def _launched(source: str) -> set[str]:
    """The programs a module launches from Python (`name[grid](...)`)."""
    import re

    return set(re.findall(r"(\w+)\[\(", source))


def test_every_triton_program_compiles_for_a_gpu(monkeypatch, tmp_path):
    import inspect
    import json
    import subprocess
    import sys

    from kvsqueeze.kernels.triton import attend, encode, passes

    launches = set()

    class Recorder:
        def __init__(self, module: str, name: str, program):
            self.module, self.name, self.program = module, name, program

        def __getitem__(self, grid):
            launch = self.program[grid]

            def run(*args, **kwargs):
                launches.add((self.module, self.name, tuple(_tl_type(a) for a in args), tuple(sorted(kwargs.items()))))
                return launch(*args, **kwargs)
            return run

    programs = {("passes", n) for n in _launched(inspect.getsource(attend))} | {
        ("encode", n) for n in _launched(inspect.getsource(encode))}
    for module, name in programs:
        owner = {"passes": passes, "encode": encode}[module]
        monkeypatch.setattr(owner, name, Recorder(module, name, getattr(owner, name)))
    g = torch.Generator().manual_seed(3)
    stores = [make_store(40, 2, 2, 64, bits, 0.02, 1, seed=bits) for bits in (2, 3, 4)]
    stores += [make_store(33, 1, 2, 80, 3, 0.0, 0), make_mixed_store(17, 2, 3, 64, 0.01, 2)[0]]
    for store in stores:
        kv = view_of(store)
        b, d = kv.k_codes.shape[1], kv.head_dim
        q = torch.randn(b, kv.heads * 3, d, generator=g)
        for variant in [kv, *outlier_variants(kv)]:
            decode_attention(q, variant, Rope.default(d), d**-0.5, backend=Backend.TRITON)
        decode_attention(q, kv, Rope(Rope.default(d // 2).inv_freq), d**-0.5, backend=Backend.TRITON,
                         key_mask=torch.rand(b, kv.tokens, generator=g) > 0.2, softcap=30.0,
                         sink_logits=torch.randn(kv.heads * 3, generator=g))
    c = 2 * 64
    keys, values = random_kv(2, 20, c, g)
    for fraction in (0.0, 0.02):
        store = KVStore(*make_quantizers(keys.reshape(-1, c), 3, fraction), c, 1, head_dim=64, encoder="triton")
        store.append(keys, values)
    assert {(m, n) for m, n, _, _ in launches} == programs  # every program, in at least one variant
    records = tmp_path / "launches.json"
    records.write_text(json.dumps(sorted([m, n, list(t), [list(kv) for kv in c]] for m, n, t, c in launches)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU, str(records)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
