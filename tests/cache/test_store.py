"""Tests for kvsqueeze.cache storage (pure torch): growable buffers, CSC/CSR outliers, the per-layer store.

The reference for the store is the simulated quantization of the whole
sequence at once: `VectorQuantizer.fake` on every non-sink token (keys per
channel and values per token are computed independently for each element /
token, so chunking must not matter) and fp16 for each row's first real tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.cache import sparse as sparse_mod
from kvsqueeze.cache.buffers import GrowableTensor
from kvsqueeze.cache.sparse import TokenOutliers
from kvsqueeze.cache.store import KVStore, WindowCropError
from kvsqueeze.numerics.datatypes import normal_float_levels, uniform_levels
from kvsqueeze import storage
from kvsqueeze.methods import parse_method
from kvsqueeze.numerics.packing import unpack_codes
from kvsqueeze.numerics.quantizer import VectorQuantizer

FAST = settings(max_examples=40, deadline=None)


# ---- growable buffers -----------------------------------------------------------------------
def test_growable_appends_are_amortized():
    buf = GrowableTensor((3,), torch.float32)
    reallocations, last = 0, None
    for i in range(1000):
        buf.append(torch.full((1, 3), float(i)))
        if buf._data.data_ptr() != last:
            reallocations, last = reallocations + 1, buf._data.data_ptr()
    assert reallocations == 7  # 16, 32, ..., 1024: capacity doubles, never one copy per token
    assert buf.capacity_nbytes < 2 * buf.nbytes + 16 * buf.row_nbytes
    assert torch.equal(buf.view()[:, 0], torch.arange(1000, dtype=torch.float32))
    buf.truncate(10)
    assert buf.nbytes == 10 * 12 and len(buf.view()) == 10
    with pytest.raises(ValueError, match="rows of shape"):
        buf.append(torch.zeros(1, 4))


def test_growable_host_rows_write_into_the_allocation_in_use_and_never_into_an_old_or_copied_one():
    """`host_rows` is where the numba encoder writes a decode step's codes: after a reallocation, a replace, a
    conversion or a clear, and in a copy, its rows must be the allocation's now, not those it viewed before."""
    for dtype, bits in ((torch.int32, np.int32), (torch.float16, np.int16)):
        buf = GrowableTensor((2,), dtype)
        for i in range(40):  # crosses reallocations at 16 and 32 rows
            rows = buf.extend_host(1)  # the row it takes, i
            assert rows.dtype == bits
            rows[:] = np.array([[i, i + 1]], dtype=np.int16).view(bits) if bits is np.int16 else [[i, i + 1]]
        want = torch.arange(40).view(-1, 1) + torch.arange(2)
        got = buf.view().view(torch.int16) if dtype == torch.float16 else buf.view()
        assert torch.equal(got.long(), want)
        twin = copy.deepcopy(buf)
        twin.host_rows(0, 1)[:] = 0  # the copy's own allocation
        assert not twin.view()[0].any()
        assert torch.equal((buf.view().view(torch.int16) if dtype == torch.float16 else buf.view()).long(), want)
        for edit in (lambda: buf.replace(buf.view().clone()), buf.clear):
            edit()
            buf.extend(1)
            buf.host_rows(0, 1)[:] = 7
            assert torch.equal(buf.view()[:1], torch.full((1, 2), 7, dtype=torch.int16).view(dtype)
                               if dtype == torch.float16 else torch.full((1, 2), 7, dtype=dtype))
    wide = GrowableTensor((), torch.int32)
    wide.extend(3)
    wide.host_rows(0, 3)[:] = [1, 2, 3]
    wide.astype(torch.int64)
    wide.host_rows(0, 1)[:] = 2**40  # written into the int64 allocation
    assert wide.view().tolist() == [2**40, 2, 3]


def test_growable_storage_stays_until_a_reallocation_and_holds_the_rows():
    """`storage` is what the store's views hand the kernels: the same tensor while appends fit."""
    buf = GrowableTensor((2,), torch.int16)
    storages = []
    for i in range(40):  # crosses reallocations at 16 and 32 rows
        buf.append(torch.tensor([[i, -i - 1]], dtype=torch.int16))
        assert torch.equal(buf.storage[: len(buf)], buf.view()) and buf.storage.shape[0] >= len(buf)
        if not storages or storages[-1] is not buf.storage:
            storages.append(buf.storage)
    assert len(storages) == 3  # 16, 32, 64 rows
    kept = buf.storage
    buf.truncate(5)
    assert buf.storage is kept and torch.equal(buf.view(), kept[:5])
    for edit in (lambda: buf.replace(torch.ones(3, 2, dtype=torch.int16) * 7), lambda: buf.astype(torch.int32),
                 buf.clear):
        before = buf.storage
        edit()
        assert buf.storage is not before and torch.equal(buf.storage[: len(buf)], buf.view())
    assert buf.storage.dtype == torch.int32 and len(buf) == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_growable_copies_own_their_storage(how):
    buf = GrowableTensor((2,), torch.int32)
    buf.append(torch.ones(5, 2, dtype=torch.int32))
    dup = {"deepcopy": copy.deepcopy, "pickle": lambda b: pickle.loads(pickle.dumps(b))}[how](buf)
    assert dup.storage.data_ptr() != buf.storage.data_ptr()
    dup.append(torch.full((3, 2), 7, dtype=torch.int32))  # into spare capacity: no reallocation
    assert dup.view()[-1].tolist() == [7, 7] and len(buf) == 5


def _to_dense(s: TokenOutliers) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [tokens, C] bool, values [tokens, C] fp16, zero off the outliers)."""
    mask = torch.zeros(s.tokens, s.width, dtype=torch.bool)
    vals = torch.zeros(s.tokens, s.width, dtype=torch.float16)
    rows, cols = s.token_index(), s.channel_index()
    mask[rows, cols] = True
    vals[rows, cols] = s.values.view()
    return mask, vals


def _tensors_in_use(store: KVStore) -> list[torch.Tensor]:
    """Every tensor a store holds (the rows in use), for a byte count independent of its own."""
    out = [buf.view() for buf in (store.k_codes, store.v_codes, store.v_scale_zero)]
    for sp in (store.k_outliers, store.v_outliers):
        if sp is not None:
            out += [sp.channels.view(), sp.values.view()] + ([] if sp.fixed is not None else [sp.pointers.view()])
    out += [store.k_scale, store.k_zero, store.sink_slot]
    filled = store.sink_slot >= 0
    return out + [store.sink_k[filled], store.sink_v[filled]]


# ---- CSC / CSR outliers ---------------------------------------------------------------------
def _random_outliers(n: int, c: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, generator=g) < density, torch.randn(n, c, generator=g) * 10


def _arrays(s: TokenOutliers) -> tuple[torch.Tensor, ...]:
    return s.pointers.view().long(), s.channels.view(), s.values.view()


def _same(a: TokenOutliers, b: TokenOutliers) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_arrays(a), _arrays(b)))


@FAST
@given(
    chunks=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    c=st.sampled_from([1, 7, 32, 100]),
    density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_outliers_built_by_appends_equal_built_at_once(chunks, c, density, seed):
    n = sum(chunks)
    mask, x = _random_outliers(n, c, density, seed)
    at_once = TokenOutliers.from_dense(mask, x)
    appended = TokenOutliers(c)
    start = 0
    for k in chunks:
        appended.append(mask[start : start + k], x[start : start + k])
        start += k
    assert _same(appended, at_once)
    assert appended.tokens == n and appended.nnz == int(mask.sum())
    dense_mask, vals = _to_dense(appended)
    assert torch.equal(dense_mask, mask) and torch.equal(vals[mask], x[mask].half())


@FAST
@given(n=st.integers(0, 12), keep=st.integers(0, 12), seed=st.integers(0, 10_000),
       order=st.lists(st.integers(0, 11), max_size=15))
def test_outliers_truncate_and_select_match_a_fresh_build(n, keep, seed, order):
    mask, x = _random_outliers(n, 9, 0.3, seed)
    s = TokenOutliers.from_dense(mask, x)
    keep = min(keep, n)
    s.truncate(keep)
    assert _same(s, TokenOutliers.from_dense(mask[:keep], x[:keep]))
    idx = torch.tensor([i for i in order if i < keep], dtype=torch.long)
    s.select(idx)
    assert _same(s, TokenOutliers.from_dense(mask[:keep][idx], x[:keep][idx]))


@FAST
@given(chunks=st.lists(st.integers(0, 4), min_size=1, max_size=6), c=st.sampled_from([1, 7, 32]),
       density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 10_000))
def test_outliers_appended_unsettled_equal_counted_ones(chunks, c, density, seed):
    """Appends that leave room instead of reading how many outliers came (decode steps) point at the same
    outliers at once, and hold exactly them once settled."""
    n = sum(chunks)
    mask, x = _random_outliers(n, c, density, seed)
    counted, loose = TokenOutliers(c), TokenOutliers(c)
    start = 0
    for i, k in enumerate(chunks):
        counted.append(mask[start : start + k], x[start : start + k])
        (loose.append_unsettled if i % 3 else loose.append)(mask[start : start + k], x[start : start + k])
        start += k
    ptr = loose.pointers.view()
    assert torch.equal(ptr, counted.pointers.view()) and loose.entries >= int(ptr[-1])
    assert torch.equal(loose.channels.view()[: int(ptr[-1])], counted.channels.view())
    assert torch.equal(loose.values.view()[: int(ptr[-1])], counted.values.view())
    loose.settle()
    assert _same(loose, counted) and not loose.unsettled


def test_fixed_rows_are_padded_with_their_first_free_channels():
    s = TokenOutliers(6, fixed=2)
    mask = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    x = torch.arange(18.0).view(3, 6)
    stored = s.append_unsettled(mask, x)
    assert s.channel_index().tolist() == [1, 4, 0, 3, 0, 1]
    assert s.values.view().tolist() == [1.0, 4.0, 6.0, 9.0, 12.0, 13.0]
    assert stored.sum(dim=1).tolist() == [2, 2, 2] and (stored | ~mask).all()


def test_outlier_channel_indices_use_all_16_bits():
    c = 65_536
    mask = torch.zeros(2, c, dtype=torch.bool)
    mask[0, [0, 32_767, 32_768]] = True
    mask[1, c - 1] = True
    x = torch.randn(2, c)
    s = TokenOutliers.from_dense(mask, x)
    assert s.channels.dtype == torch.int16
    assert s.channel_index().tolist() == [0, 32_767, 32_768, c - 1]
    dense = s.scatter_into(torch.zeros(2, c))
    assert torch.equal(dense[mask], x[mask].half().float())
    with pytest.raises(ValueError, match="16 bits"):
        TokenOutliers(c + 1)


def test_outlier_pointers_widen_instead_of_overflowing(monkeypatch):
    monkeypatch.setattr(sparse_mod, "_INT32_MAX", 5)
    mask, x = _random_outliers(6, 4, 1.0, 0)  # 24 outliers > the patched limit
    s = TokenOutliers(4)
    s.append(mask[:1], x[:1])
    assert s.pointers.dtype == torch.int32
    s.append(mask[1:], x[1:])
    assert s.pointers.dtype == torch.int64
    assert s.pointers.view().tolist() == [0, 4, 8, 12, 16, 20, 24]


# ---- the per-layer store --------------------------------------------------------------------
def _quantizers(c: int, bits: int, fraction: float, scope: str, family: str = "nuq"):
    g = torch.Generator().manual_seed(c * 10 + bits)
    if family == "nuq":
        levels = torch.sort(torch.rand(2**bits, generator=g) * 2 - 1).values
        levels[0], levels[-1] = -1.0, 1.0
    else:
        levels = normal_float_levels(bits) if family == "nf" else uniform_levels(bits)
    lo = -1.5 - torch.rand(c, generator=g)
    hi = 1.0 + torch.rand(c, generator=g)
    kq = VectorQuantizer(levels=levels, axis="channel", fraction=fraction, scope=scope, lo=lo, hi=hi)
    mat = dict(mat_lo=-2.0, mat_hi=2.0) if scope == "matrix" else {}
    vq = VectorQuantizer(levels=levels, axis="token", fraction=fraction, scope=scope, **mat)
    return kq, vq


def _reference(kq, vq, keys, values, real, sinks):
    """Simulated quantization of whole sequences [B, T, C]: the first `sinks` real tokens of a row stay fp16."""
    b, t, c = keys.shape
    rank = real.long().cumsum(1) - 1
    sink = real & (rank < sinks)
    k_hat = kq.fake(keys.reshape(-1, c))[0].view(b, t, c)
    v_hat = vq.fake(values.reshape(-1, c))[0].view(b, t, c)
    k_hat = torch.where(sink[..., None], keys.half().float(), k_hat)
    v_hat = torch.where(sink[..., None], values.half().float(), v_hat)
    return k_hat, v_hat


def _tokens(b: int, t: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, t, c, generator=g) * 1.2 - 0.2
    v = torch.randn(b, t, c, generator=g)
    spikes = torch.rand(b, t, c, generator=g) < 0.03  # outliers on both sides
    return k + spikes * 6 * torch.randn(b, t, c, generator=g), v + spikes * 8


ops = st.lists(st.tuples(st.sampled_from(["append", "append", "crop", "reorder", "drop"]), st.integers(1, 5)),
               min_size=1, max_size=8)


@FAST
@given(
    ops=ops,
    batch=st.integers(1, 3),
    c=st.sampled_from([32, 40]),
    bits=st.sampled_from([2, 3, 4]),
    outliers=st.sampled_from([(0.0, "vector"), (0.05, "vector"), (0.05, "matrix")]),
    sinks=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_store_holds_exactly_the_simulated_quantization_of_the_sequence(ops, batch, c, bits, outliers, sinks, seed):
    """Random prefills, appends, crops, row reorders and drops of the oldest tokens (a sliding window) never lose,
    duplicate or reorder a token; a dropped sink is not replaced by a later token."""
    kq, vq = _quantizers(c, bits, *outliers)
    store = KVStore(kq, vq, c, sinks)
    g = torch.Generator().manual_seed(seed)
    pads = torch.randint(0, 3, (batch,), generator=g)  # left padding: leading tokens that are not real
    keys = torch.zeros(batch, 0, c)  # the whole history; the store holds it from slot `dropped` on
    values, real = torch.zeros(batch, 0, c), torch.zeros(batch, 0, dtype=torch.bool)
    dropped = 0
    for step, (op, n) in enumerate(ops):
        if op == "append":
            k, v = _tokens(batch, n, c, seed + step)
            slots = torch.arange(keys.shape[1], keys.shape[1] + n).view(1, -1)
            r = slots >= pads.view(-1, 1)
            store.append(k, v, r)
            keys, values, real = torch.cat([keys, k], 1), torch.cat([values, v], 1), torch.cat([real, r], 1)
        elif op == "crop":
            keep = max(store.tokens - n, 0)
            store.crop(keep)
            keys, values, real = keys[:, : dropped + keep], values[:, : dropped + keep], real[:, : dropped + keep]
        elif op == "drop":
            n = min(n, store.tokens)
            store.drop_front(n)
            dropped += n
        elif store.tokens:
            idx = torch.randint(0, batch, (batch,), generator=g)  # beams may duplicate rows
            store.gather_rows(idx)
            keys, values, real, pads = keys[idx], values[idx], real[idx], pads[idx]
        assert store.tokens == keys.shape[1] - dropped
        if store.tokens:
            k_got, v_got = store.dequantize()
            k_ref, v_ref = _reference(kq, vq, keys, values, real, sinks)
            assert torch.equal(k_got.transpose(0, 1), k_ref[:, dropped:])
            assert torch.equal(v_got.transpose(0, 1), v_ref[:, dropped:])
            _assert_replaced_codes_are_outlier_code(store)


def _assert_replaced_codes_are_outlier_code(store: KVStore) -> None:
    """Codes under every stored outlier (padding entries included) and in sink slots are OUTLIER_CODE: the kernels
    take the element an outlier replaces from that code without reading the codes."""
    t, b, c = store.tokens, store.batch, store.channels
    for codes, bits, sparse in ((store.k_codes, store.k_bits, store.k_outliers),
                                (store.v_codes, store.v_bits, store.v_outliers)):
        dense = unpack_codes(codes.view(), bits, c).view(t * b, c)
        if sparse is not None and sparse.nnz:
            under = dense[sparse.token_index(), sparse.channel_index()]
            assert (under == store.OUTLIER_CODE).all()
        rows, ranks = (store.sink_slot >= 0).nonzero(as_tuple=True)
        slots = store.sink_slot[rows, ranks].long() * b + rows
        assert (dense[slots] == store.OUTLIER_CODE).all()


def _store_arrays(store: KVStore) -> dict[str, torch.Tensor]:
    store.settle()  # decode steps leave room past the outliers, which differs from store to store
    out = {"k_codes": store.k_codes.view(), "v_codes": store.v_codes.view(), "v_scale_zero": store.v_scale_zero.view(),
           "sink_k": store.sink_k, "sink_v": store.sink_v, "sink_slot": store.sink_slot}
    for name, sparse in (("k", store.k_outliers), ("v", store.v_outliers)):
        if sparse is not None:
            out |= {f"{name}_pointers": sparse.pointer_view(), f"{name}_channels": sparse.channels.view(),
                    f"{name}_values": sparse.values.view()}
    return out


@pytest.mark.parametrize("c, bits, fraction, sinks, family", [
    (32, 3, 0.05, 1, "nuq"), (40, 2, 0.0, 0, "nf"), (80, 4, 0.05, 2, "int"), (130, 3, 0.02, 3, "nuq"),
    (64, 2, 0.01, 0, "nuq"),
])
def test_triton_encoder_writes_the_bits_of_the_torch_path(c, bits, fraction, sinks, family):
    """The fused quantize-and-pack of new tokens (a GPU store's encoder; Triton's interpreter here) against the
    torch ops, array by array, over a left-padded prefill and single-token decode steps."""
    kq, vq = _quantizers(c, bits, fraction, "vector", family=family)
    stores = [KVStore(kq, vq, c, sinks, encoder=enc) for enc in ("torch", "triton")]
    assert [store.encoder for store in stores] == ["torch", "triton"]
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :4] = False
    chunks = [(9, real)] + [(1, None)] * 3
    for step, (n, r) in enumerate(chunks):
        k, v = _tokens(2, n, c, 100 + step)
        for store in stores:
            store.append(k, v, r)
    got, want = _store_arrays(stores[1]), _store_arrays(stores[0])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(stores[1].dequantize()[1], stores[0].dequantize()[1])


def _own_widths(kq, vq, c: int):
    """The quantizers with a random width of 1 to 6 bits per channel (a ':chan' budget), a codebook per width."""
    g = torch.Generator().manual_seed(c)
    books = {w: uniform_levels(w) if w == 1 else normal_float_levels(w) for w in range(1, 7)}
    return (dataclasses.replace(q, widths=torch.randint(1, 7, (c,), generator=g), codebooks=books, levels=books[6])
            for q in (kq, vq))


@pytest.mark.parametrize("c, bits, fraction, sinks, window, family, widths", [
    (32, 3, 0.05, 1, 0, "nuq", False), (40, 2, 0.0, 0, 0, "nf", False), (80, 4, 0.05, 2, 3, "int", False),
    (130, 3, 0.02, 3, 0, "nuq", True), (64, 2, 0.01, 0, 4, "nuq", True), (192, 3, 0.01, 1, 32, "nuq", True),
])
def test_numba_encoder_writes_the_bits_of_the_torch_path(c, bits, fraction, sinks, window, family, widths):
    """The CPU's fused quantize-and-pack (`kernels.numba.encode`) against the torch ops, array by array, over a
    left-padded prefill (sinks and padding: the torch ops), chunks of several tokens and single-token steps (the
    numba encoder), with one width or a width per channel (1 to 6 bits), with and without an fp16 window."""
    kq, vq = _quantizers(c, bits, fraction, "vector", family=family)
    if widths:
        kq, vq = _own_widths(kq, vq, c)
    stores = [KVStore(kq, vq, c, sinks, encoder=enc, window=window) for enc in ("torch", "numba")]
    assert [store.encoder for store in stores] == ["torch", "numba"]
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :4] = False
    chunks = [(9, real), (5, None)] + [(1, None)] * 4 + [(3, torch.ones(2, 3, dtype=torch.bool))]
    for step, (n, r) in enumerate(chunks):
        k, v = _tokens(2, n, c, 100 + step)
        for store in stores:
            store.append(k, v, r)
        got, want = _store_arrays(stores[1]), _store_arrays(stores[0])
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name)
    assert torch.equal(stores[1].dequantize()[1], stores[0].dequantize()[1])
    assert stores[1].k_outliers is None or stores[1].k_outliers.tokens == stores[1].tokens * 2


def test_numba_encoder_matches_torch_on_ties_and_extremes():
    """Values with ties among the largest and smallest (the lower channel is the outlier, as the torch path keeps
    it), keys on the very edges of their range, and magnitudes near fp16's limits and its subnormals."""
    c = 48
    kq, vq = _quantizers(c, 3, 0.05, "vector")
    stores = [KVStore(kq, vq, c, 0, encoder=enc) for enc in ("torch", "numba")]
    k = torch.stack([kq.lo, kq.hi, kq.lo - 1e-3, kq.hi + 60000.0]).view(1, 4, c)
    v = torch.randn(1, 4, c)
    v[0, 0, [3, 9, 20]] = 5.0  # ties among the largest
    v[0, 1, [2, 7]] = -7.0  # and the smallest
    v[0, 2] = torch.randn(c) * 1e-7  # a scale below fp16's normal range
    v[0, 3] = 6.0e4 * torch.rand(c).sign()
    for store in stores:
        store.append(k, v)
    got, want = _store_arrays(stores[1]), _store_arrays(stores[0])
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_store_encoder_is_explicit():
    kq, vq = _quantizers(32, 3, 0.05, "vector")
    assert KVStore(kq, vq, 32).encoder == "numba"  # a CPU store
    kq, vq = _quantizers(32, 3, 0.05, "matrix")
    assert KVStore(kq, vq, 32, encoder="triton").encoder == "torch"  # per-matrix value thresholds: torch alone
    assert KVStore(kq, vq, 32, encoder="numba").encoder == "torch"
    with pytest.raises(ValueError, match="encoder must be"):
        KVStore(kq, vq, 32, encoder="cuda")


def test_store_reset_empties_it():
    kq, vq = _quantizers(32, 3, 0.05, "vector")
    store = KVStore(kq, vq, 32, sinks=1)
    store.append(*_tokens(2, 5, 32, 0))
    store.reset()
    assert store.tokens == 0 and store.batch == 0
    k, v = _tokens(3, 4, 32, 1)
    store.append(k, v)  # a new batch size after a reset
    k_ref, _ = _reference(kq, vq, k, v, torch.ones(3, 4, dtype=torch.bool), 1)
    assert torch.equal(store.dequantize()[0].transpose(0, 1), k_ref)


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq2-1%", "nuq4", "nuq3-1%:pm", "nf3-1%:kchan:pre:sink2",
                                    "nuq3-1%:kslots3"])
@pytest.mark.parametrize("padded", [False, True])
def test_store_memory_is_exact_and_equals_the_storage_count(method, padded):
    """Every byte the store's arrays hold is in its report, once, and the report is `storage.layer_bytes` of the
    method's layout (padding tokens are stored like any other; the first real token is the sink)."""
    spec = parse_method(method)
    c, t = 64, 37
    kq, vq = _quantizers(c, spec.k_bits, spec.outlier_fraction, spec.outlier_scope, spec.family)
    kq = dataclasses.replace(kq, slots=spec.key_slots)
    store = KVStore(kq, vq, c, spec.sinks)
    k, v = _tokens(1, t, c, 3)
    real = (torch.arange(t) >= 4).view(1, -1) if padded else None
    store.append(k[:, :20], v[:, :20], None if real is None else real[:, :20])
    store.append(k[:, 20:], v[:, 20:], None if real is None else real[:, 20:])
    mem = store.component_bytes()
    in_tensors = sum(x.nbytes for x in _tensors_in_use(store))
    assert sum(mem.values()) - mem["codebook"] == in_tensors  # every byte in use is counted, once
    assert store.capacity_nbytes() >= sum(mem.values())
    # a key slot count, per-token top-k values: fixed counts, implicit row pointers, sinks padded
    n_k = store.k_outliers.nnz - spec.sinks * spec.key_slots if store.k_outliers is not None else 0
    fixed = store.v_fixed or 0
    n_v = store.v_outliers.nnz - spec.sinks * fixed if store.v_outliers is not None else 0
    k_layout = storage.Layout("k", storage.Choice(spec.k_bits, spec.outlier_fraction), spec.outlier_scope,
                              spec.key_slots)
    v_layout = storage.Layout("v", storage.Choice(spec.v_bits, spec.outlier_fraction), spec.outlier_scope)
    want = storage.layer_bytes(k_layout, v_layout, c, storage.Rows(t, (4 if padded else 0,)), spec.sinks, 0,
                               k_outliers=n_k, v_outliers=n_v)
    assert {k: v for k, v in want.items() if k != "positions"} == mem
    if spec.key_slots:
        assert n_k == spec.key_slots * (t - spec.sinks)  # exactly that many per quantized token


def test_store_rejects_other_axes():
    kq, vq = _quantizers(32, 3, 0.0, "vector")
    with pytest.raises(ValueError, match="per-channel keys and per-token values"):
        KVStore(vq, kq, 32, 1)


def test_store_views_share_one_memo_until_an_allocation_changes():
    """A decode step builds a view; a backend keeps its derived data in the memo, which must survive from one
    step to the next while the store keeps its allocations, and must be dropped with them."""
    kq, vq = _quantizers(32, 3, 0.05, "vector")
    store = KVStore(kq, vq, 32, sinks=1, head_dim=16)
    store.append(*_tokens(2, 5, 32, 0))

    def allocations():
        sparse = [t for s in (store.k_outliers, store.v_outliers) for t in s.storages]
        return [store.k_codes.storage, store.v_codes.storage, store.v_scale_zero.storage, *sparse]

    before, view = allocations(), store.view()
    view.memo["derived"] = 1
    kept = grown = 0
    for step in range(40):
        assert store.view().memo is view.memo
        store.append(*_tokens(2, 1, 32, step + 1))
        same = all(a is b for a, b in zip(allocations(), before))
        new = store.view()
        assert (new.memo is view.memo) == same and ("derived" in new.memo) == same
        assert new.tokens == 6 + step and torch.equal(new.trim().k_codes, store.k_codes.view())
        kept, grown = kept + same, grown + (not same)
        before, view = allocations(), new
        view.memo["derived"] = 1
    assert kept > 20 and grown >= 2  # most steps append into spare capacity; some reallocate
    store.gather_rows(torch.tensor([1, 0]))  # a batch edit replaces the arrays too
    assert "derived" not in store.view().memo


@pytest.mark.parametrize("c, bits, fraction, sinks, window, widths", [
    (32, 3, 0.05, 1, 0, False), (80, 4, 0.05, 2, 3, False), (130, 3, 0.02, 3, 0, True), (192, 3, 0.01, 1, 32, True),
])
def test_a_prompt_after_its_sinks_goes_through_the_numba_encoder(c, bits, fraction, sinks, window, widths,
                                                                   monkeypatch):
    """A first forward without padding: its sinks through the torch ops, every later token of it in one numba
    call, the same bits as the torch path's whole prompt; a prompt no longer than its sinks stays with torch."""
    kq, vq = _quantizers(c, bits, fraction, "vector")
    if widths:
        kq, vq = _own_widths(kq, vq, c)
    encoded = []
    original = KVStore._append_numba
    monkeypatch.setattr(KVStore, "_append_numba", lambda self, k, v, t, b: encoded.append(t) or original(self, k, v, t, b))
    for n in (40, sinks):
        stores = [KVStore(kq, vq, c, sinks, encoder=enc, window=window) for enc in ("torch", "numba")]
        encoded.clear()
        k, v = _tokens(2, n, c, 7 + n)
        pos = torch.arange(5, 5 + n).expand(2, n)
        for store in stores:
            store.append(k, v, None, pos)
        assert encoded == ([n - sinks] if n > sinks else [])
        got, want = _store_arrays(stores[1]), _store_arrays(stores[0])
        for name in want:
            assert torch.equal(got[name], want[name]), (n, name)
        assert torch.equal(stores[1].positions.view(), stores[0].positions.view())
        for a, b in zip(stores[1].dequantize(), stores[0].dequantize()):
            assert torch.equal(a, b)


def test_a_prompt_appended_at_once_keeps_no_worst_case_room_for_its_outliers():
    """The numba encoder reserves room for every element of a prompt to be a key outlier (N * C entries) and
    writes the few it keeps; that room was kept for good, so a 4K-token prompt held more than an fp16 cache.
    Both encoders now hold about what they use."""
    c, t = 256, 4096
    kq, vq = _quantizers(c, 3, 0.01, "vector", "nuq")
    k, v = _tokens(1, t, c, 0)
    held = {}
    for encoder in ("torch", "numba"):
        store = KVStore(kq, vq, c, 0, encoder=encoder)
        store.append(k, v)
        held[encoder] = store.capacity_nbytes()
        assert store.capacity_nbytes() < 2 * sum(store.component_bytes().values()) + (1 << 20), encoder
    assert held["numba"] < 2 * t * c * 2  # under an fp16 cache of the same tokens


def test_a_crop_that_cuts_nothing_leaves_a_wrapped_window_as_it_is():
    """A crop to the present length once repacked the window's ring as if it had not wrapped, and the next crop
    into it was then let through, reading a token from its codes that the window should have held exactly."""
    kq, vq = _quantizers(32, 3, 0.05, "vector", "nuq")
    store = KVStore(kq, vq, 32, 1, window=2)
    k, v = _tokens(1, 6, 32, 0)
    store.append(k, v)
    assert store.crop_blocker(4) is not None
    store.crop(6)
    assert store.crop_blocker(4) is not None
    with pytest.raises(WindowCropError):
        store.crop(4)
