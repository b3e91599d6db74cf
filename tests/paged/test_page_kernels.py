"""The numba page kernels against the torch page path: the same bytes written, the same floats read back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from kvsqueeze.kernels import decode_attention
from kvsqueeze.kernels.numba import pages as page_kernels  # a numba that cannot load fails here, not silently
from kvsqueeze.kernels.numba.dequant import dequantize_view as numba_dequantize_view
from kvsqueeze.kernels.numba.simd import half_bits
from kvsqueeze.kernels.reference import dequantize_view
from kvsqueeze.paged.layout import PageLayout
from kvsqueeze.numerics.rope import Rope

from test_pages import _quantizers

CASES = [  # channels, head_dim, bits, outlier fraction, sinks, key slots, block size
    (64, 32, 3, 0.02, 1, 4, 8), (128, 64, 2, 0.01, 0, 3, 16), (96, 32, 4, 0.05, 2, 8, 8), (64, 64, 3, 0.0, 1, 0, 4),
    (576, 64, 3, 0.01, 1, 6, 128), (160, 32, 1, 0.03, 3, 5, 4),
    # channels with widths of their own (a ':chan' budget): codes straddle words
    (96, 32, 3, 0.02, 1, 4, 8, (1, 2, 3, 4, 5, 6)), (128, 64, 2, 0.0, 0, 0, 16, (2, 3)),
]


def _pair(c, d, bits, fraction, sinks, key_slots, bs, widths=(), seed=0):
    kq, vq = _quantizers(c, bits, fraction, seed=seed, slots=key_slots, widths=widths)
    return (PageLayout(kq, vq, c, d, block_size=bs, sinks=sinks, kernels="torch"),
            PageLayout(kq, vq, c, d, block_size=bs, sinks=sinks, kernels="numba"))


def _sequences(layout, lens, seed):
    """Random keys (some past the calibrated ranges, some tokens over the slot budget) and values, their slots in
    shuffled pages, and the block table."""
    g = torch.Generator().manual_seed(seed)
    bs, c = layout.block_size, layout.channels
    need = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(need) + 2, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    out, used = [], 0
    for i, n in enumerate(lens):
        table[i, :need[i]] = order[used:used + need[i]]
        used += need[i]
        k = torch.randn(n, c, generator=g) * (0.5 + torch.rand(1, c, generator=g))
        v = torch.randn(n, c, generator=g) * (0.1 + 3 * torch.rand(n, 1, generator=g))
        pos = torch.arange(n)
        out.append((k, v, table[i, pos // bs].long() * bs + pos % bs, pos))
    return out, table, sum(need) + 2


@pytest.mark.parametrize("case", CASES)
def test_numba_writes_the_bytes_torch_writes(case):
    """Chunked writes (as prefill chunks and decode steps come) with padding slots: every byte of every page
    equal, the garbage a page held before included, and the same clipped-outlier counts."""
    ref, fast = _pair(*case)
    lens = [37, 1, 2 * case[6] + 3]
    seqs, _, n_pages = _sequences(ref, lens, seed=1)
    g = torch.Generator().manual_seed(2)
    pages_ref = ref.allocate(n_pages)
    pages_ref.copy_(torch.randint(0, 256, pages_ref.shape, generator=g, dtype=torch.uint8))
    pages_fast = pages_ref.clone()
    for k, v, slots, pos in seqs:
        for chunk in torch.arange(len(pos)).split(7):
            s = slots[chunk].clone()
            s[-1:] = -1 if len(chunk) > 2 else s[-1:]  # a padding slot: skipped by both
            a = ref.write(pages_ref, s, k[chunk], v[chunk], pos[chunk])
            b = fast.write(pages_fast, s, k[chunk], v[chunk], pos[chunk])
            assert a == b
    assert torch.equal(pages_ref, pages_fast)


def test_tied_values_take_the_same_exact_channels_in_both_writers():
    """Tokens whose values tie (all zeros, a constant, zeros with one high and one low): the smallest are chosen
    among the channels the largest left, as the torch path and the store's encoder choose them; the numba writer
    once searched every channel for them and kept fewer exact values, padded with empty slots."""
    ref, fast = _pair(64, 32, 3, 0.05, 0, 4, 8)
    keys = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 0.5
    values = torch.zeros(3, 64)
    values[1] = 0.3
    values[2, 5], values[2, 9] = 4.0, -4.0
    pages_ref = ref.allocate(2).zero_()
    pages_fast = pages_ref.clone()
    slots, pos = torch.arange(3), torch.arange(3) + 5
    ref.write(pages_ref, slots, keys, values, pos)
    fast.write(pages_fast, slots, keys, values, pos)
    assert torch.equal(pages_ref, pages_fast)


@pytest.mark.parametrize("case", CASES)
def test_numba_reads_and_gathers_what_torch_does(case):
    ref, fast = _pair(*case, seed=4)
    lens = [29, 1, 3 * case[6] + 1]
    seqs, table, n_pages = _sequences(ref, lens, seed=5)
    pages = ref.allocate(n_pages)
    pages.random_(0, 256)
    for k, v, slots, pos in seqs:
        ref.write(pages, slots, k, v, pos)
    lens_t = torch.tensor(lens)
    v_ref, m_ref = ref.view(pages, table, lens_t)
    v_fast, m_fast = fast.view(pages, table, lens_t)
    assert torch.equal(m_ref, m_fast)
    for name in ("k_codes", "v_codes", "v_scale_zero", "sink_k", "sink_v", "sink_slot", "positions"):
        a, b = getattr(v_ref, name), getattr(v_fast, name)
        if a.dtype == torch.float16:  # bit patterns: a sink slot no token filled holds whatever bytes, NaN too
            a, b = a.view(torch.int16), b.view(torch.int16)
        assert torch.equal(a, b), name
    for name in ("k_outliers", "v_outliers"):
        a, b = getattr(v_ref, name), getattr(v_fast, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.channels, b.channels) and torch.equal(a.values.view(torch.int16),
                                                                       b.values.view(torch.int16))
    k_all, v_all = dequantize_view(v_ref)  # [T, B, C]
    for b, n in enumerate(lens):
        for layout in (ref, fast):
            k, v = layout.read(pages, table[b], n)
            assert k.dtype == v.dtype == torch.float32
            assert torch.equal(k, k_all[:n, b]) and torch.equal(v, v_all[:n, b])


@njit(cache=True)
def _halves(x, out):
    for i in range(x.shape[0]):
        out[i] = half_bits(x[i])


def test_half_rounding_is_torchs():
    """Every kind of float32: normal, halfway cases, subnormal in fp16, overflowing it, infinities."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11,
                             1 + 3 * 2.0**-11, float("inf"), float("-inf"), 1e30, -1e-30])
    x = torch.cat([x, specials, torch.randn(10_000, generator=g) * 100])
    out = np.empty(x.numel(), np.uint16)
    _halves(x.numpy(), out)
    assert np.array_equal(out, x.half().view(torch.int16).numpy().view(np.uint16))


def test_kernel_choice_is_checked():
    kq, vq = _quantizers(64, 3, 0.01, slots=2)
    with pytest.raises(ValueError, match="kernels must be one of"):
        PageLayout(kq, vq, 64, 32, block_size=4, kernels="cuda")
    layout = PageLayout(kq, vq, 64, 32, block_size=4, kernels="numba")
    with pytest.raises(ValueError, match="sequence of 0 tokens"):
        layout.read(layout.allocate(1), torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="need 2 pages"):
        layout.read(layout.allocate(1), torch.tensor([0, 5]), 6)


@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_a_block_is_its_own_bytes(kernels):
    """What an engine does to blocks as raw memory — zeroing a newly allocated one (vLLM: kv[block].zero_()) and
    copying one on write — touches that block's tokens only: the other sequences read back the same."""
    ref, fast = _pair(64, 32, 3, 0.02, 1, 4, 8, seed=12)
    layout = ref if kernels == "torch" else fast
    lens = [21, 13]
    seqs, table, n_pages = _sequences(layout, lens, seed=13)
    pages = layout.allocate(n_pages)
    for k, v, slots, pos in seqs:
        layout.write(pages, slots, k, v, pos)
    before = [layout.read(pages, table[b], n) for b, n in enumerate(lens)]
    free = sorted(set(range(n_pages)) - set(table.flatten().tolist()))
    pages[free[0]].zero_()  # a new block handed out
    pages[free[1]].copy_(pages[int(table[0, 1])])  # a copy of sequence 0's second block
    for b, n in enumerate(lens):
        k, v = layout.read(pages, table[b], n)
        assert torch.equal(k, before[b][0]) and torch.equal(v, before[b][1])
    copied = table[0].clone()
    copied[1] = free[1]
    k, v = layout.read(pages, copied, lens[0])
    assert torch.equal(k, before[0][0]) and torch.equal(v, before[0][1])


@pytest.mark.parametrize("case", CASES)
def test_decode_reads_pages_in_place(case, monkeypatch):
    """Attention over the pages themselves (no copy: each token's slot through the block table) equals the
    reference over the gathered copy, on ragged batches, whatever garbage the pages hold past the sequences;
    numba and Triton both read the pages in place."""
    ref, _ = _pair(*case, seed=8)
    c, d, bs = case[0], case[1], case[6]
    lens = [3 * bs + 5, 1, bs, 2]
    seqs, table, n_pages = _sequences(ref, lens, seed=9)
    pages = ref.allocate(n_pages)
    pages.random_(0, 256)  # slots no token wrote: garbage bytes, NaN and Inf patterns among them
    for k, v, slots, pos in seqs:
        ref.write(pages, slots, k, v, pos)
    q = torch.randn(len(lens), 2 * (c // d), d, generator=torch.Generator().manual_seed(10))
    rope = Rope.default(d)
    gathered, mask = ref.view(pages, table, torch.tensor(lens))
    paged, mask_paged = ref.view(pages, table, torch.tensor(lens), in_place=True)
    assert paged.rows is not None and paged.k_codes.data_ptr() == pages.data_ptr()  # no copy
    assert torch.equal(mask, mask_paged)
    again = paged.gathered()
    live = mask.t().reshape(-1)  # slots past a sequence's end differ: zeroed in one, its first slot in the other
    for name in ("k_codes", "v_codes", "v_scale_zero"):
        a, b = getattr(gathered, name), getattr(again, name)
        assert torch.equal(a.reshape(-1, a.shape[-1])[live].view(torch.int16),
                           b.reshape(-1, b.shape[-1])[live].view(torch.int16)), name
    want = decode_attention(q, gathered, rope, d**-0.5, key_mask=mask, backend="reference")
    got = decode_attention(q, paged, rope, d**-0.5, key_mask=mask, backend="numba")
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    copy = decode_attention(q, gathered, rope, d**-0.5, key_mask=mask, backend="numba")
    torch.testing.assert_close(got, copy, rtol=0, atol=0)  # the same arithmetic, in place or on the copy
    torch.testing.assert_close(decode_attention(q, paged, rope, d**-0.5, key_mask=mask, backend="reference"), want,
                               rtol=1e-6, atol=1e-7)
    if case[6] <= 16:  # Triton (its interpreter here) reads the pages in place as well: no gathered copy
        from kvsqueeze.kernels.view import StoreView

        def no_copy(self):
            raise AssertionError("the triton backend copied the pages")

        monkeypatch.setattr(StoreView, "gathered", no_copy)
        torch.testing.assert_close(decode_attention(q, paged, rope, d**-0.5, key_mask=mask, backend="triton"), want,
                                   rtol=2e-4, atol=2e-5)


def test_in_place_views_are_checked_and_odd_block_sizes_are_gathered():
    kq, vq = _quantizers(64, 3, 0.02, seed=14, slots=4)
    odd = PageLayout(kq, vq, 64, 32, block_size=6, sinks=1)
    seqs, table, n_pages = _sequences(odd, [9], seed=15)
    pages = odd.allocate(n_pages)
    for k, v, slots, pos in seqs:
        odd.write(pages, slots, k, v, pos)
    view, _ = odd.view(pages, table, torch.tensor([9]), in_place=True)
    assert view.rows is None  # 6 tokens a page: not a power of two, so a gathered copy
    ref, _ = _pair(64, 32, 3, 0.02, 1, 4, 8)
    seqs, table, n_pages = _sequences(ref, [5], seed=11)
    pages = ref.allocate(n_pages)
    for k, v, slots, pos in seqs:
        ref.write(pages, slots, k, v, pos)
    view, mask = ref.view(pages, table, torch.tensor([5]), in_place=True)
    q = torch.randn(1, 4, 32)
    bad = view._replace(rows=view.rows._replace(slots=view.rows.slots.to(torch.int64)))
    with pytest.raises(ValueError, match="rows.slots must be a contiguous int32"):
        decode_attention(q, bad, Rope.default(32), 1.0, key_mask=mask, backend="numba")
    with pytest.raises(ValueError, match="need a block table"):
        ref.view(pages, table[:, :0], torch.tensor([5]))
    with pytest.raises(ValueError, match="sequences of"):
        ref.view(pages, table, torch.tensor([0]))


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]])
@pytest.mark.parametrize("extra", [48, None])
def test_pages_a_block_stride_apart_hold_and_give_what_contiguous_pages_do(case, extra):
    """An engine with a block-outermost KV layout puts a layer's pages a block stride apart (its blocks hold the
    other layers' pages between them): writing, reading, gathering and attending in place over such pages give
    the contiguous pages' bytes and floats, with either page kernel, and leave the bytes between pages alone."""
    ref, fast = _pair(*case, seed=11)
    c, d, bs = case[0], case[1], case[6]
    lens = [2 * bs + 3, 1, bs]
    seqs, table, n_pages = _sequences(ref, lens, seed=12)
    stride = ref.page_bytes + extra if extra else 2 * ref.page_bytes
    q = torch.randn(len(lens), 2 * (c // d), d, generator=torch.Generator().manual_seed(13))
    rope, lens_t = Rope.default(d), torch.tensor(lens)
    for layout in (ref, fast):
        flat = layout.allocate(n_pages)
        apart = layout.allocate(n_pages, block_stride=stride)
        assert apart.stride(0) == stride and apart.shape == flat.shape
        for k, v, slots, pos in seqs:
            assert layout.write(flat, slots, k, v, pos) == layout.write(apart, slots, k, v, pos)
        assert torch.equal(flat, apart)  # page by page
        gaps = apart.as_strided((n_pages - 1, stride - layout.page_bytes), (stride, 1), layout.page_bytes)
        assert not bool(gaps.any())  # the bytes between pages: never written
        for b, n in enumerate(lens):
            for got, want in zip(layout.read(apart, table[b], n), layout.read(flat, table[b], n)):
                assert torch.equal(got, want)
        (v1, m1), (v2, m2) = layout.view(flat, table, lens_t), layout.view(apart, table, lens_t)
        assert torch.equal(m1, m2) and torch.equal(v1.k_codes, v2.k_codes) and torch.equal(v1.v_codes, v2.v_codes)
        want = decode_attention(q, v1, rope, d**-0.5, key_mask=m1, backend="reference")
        paged, mask = layout.view(apart, table, lens_t, in_place=True)
        torch.testing.assert_close(decode_attention(q, paged, rope, d**-0.5, key_mask=mask, backend="numba"), want,
                                   rtol=2e-4, atol=2e-5)
        torch.testing.assert_close(decode_attention(q, paged, rope, d**-0.5, key_mask=mask, backend="reference"),
                                   want, rtol=1e-6, atol=1e-7)


def test_pages_not_evenly_apart_or_misaligned_are_refused():
    layout = _pair(*CASES[0])[0]
    with pytest.raises(ValueError, match="block_stride"):
        layout.allocate(3, block_stride=layout.page_bytes + 8)
    raw = torch.zeros(4 * layout.page_bytes + 16, dtype=torch.uint8)
    shifted = raw[8:8 + 3 * layout.page_bytes].view(3, layout.page_bytes)  # pages off 16-byte alignment
    with pytest.raises(ValueError, match="aligned"):
        layout.write(shifted, torch.tensor([0]), torch.randn(1, 64), torch.randn(1, 64), torch.tensor([0]))


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]])
def test_numba_dequantizes_pages_read_in_place_as_the_reference_does(case):
    """A view into the pages (block table, pages out of order, key slots, sinks in the first page): numba's
    whole-cache dequantization equals the reference's, bit for bit."""
    ref, _ = _pair(*case, seed=21)
    lens = [2 * case[6] + 3, 1, case[6]]
    seqs, table, n_pages = _sequences(ref, lens, seed=22)
    pages = ref.allocate(n_pages)
    for k, v, slots, pos in seqs:
        ref.write(pages, slots, k, v, pos)
    view, _ = ref.view(pages, table, torch.tensor(lens), in_place=True)
    assert view.rows is not None
    for got, want in zip(numba_dequantize_view(view), dequantize_view(view)):
        assert torch.equal(got, want)


def test_window_entries_written_and_read_back_as_torch_would():
    """`put_halves` writes a step's window entries (keys, then values, fp16 as torch rounds them) at each token's
    first word plus the layer's shift, skips a padding token (start -1) and leaves every other word as it was."""
    g = torch.Generator().manual_seed(3)
    n, c, layers = 5, 24, 3
    words = np.full(4 * layers * 2 * c + 7, 0x1234, np.uint16)
    starts = np.array([0, 2 * layers * 2 * c, -1, layers * 2 * c + 7, 3 * layers * 2 * c], np.int64)
    keys = torch.randn(n, c, generator=g) * 300
    values = torch.randn(n, c, generator=g)
    keys[0, 0] = 1 + 2.0**-11  # halfway between two halves: ties to even
    layer = 2
    shift = layer * 2 * c
    page_kernels.put_halves(words, starts, shift, keys.numpy(), values.numpy(), c)
    expect = np.full_like(words, 0x1234)
    for i in range(n):
        if starts[i] >= 0:
            at = starts[i] + shift
            expect[at:at + c] = keys[i].half().view(torch.int16).numpy().view(np.uint16)
            expect[at + c:at + 2 * c] = values[i].half().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(words, expect)


def test_sinks_and_window_gathered_in_one_pass_give_what_with_window_gives():
    """Each decode row's sinks (from its first page) and its window entries (from a window buffer, zeros before
    position 0) copied side by side by `sinks_and_window`, handed to `with_window(joined=True)`, give the view
    that `with_window` builds from the window's keys and values: the same exact entries, slots and attention."""
    case = (96, 32, 3, 0.02, 2, 4, 8)
    layout, _ = _pair(*case, seed=4)
    c, d, bs = case[0], case[1], case[6]
    lens = [3 * bs + 5, 1, 20, 2 * bs]
    w, layers, layer = 6, 3, 1
    seqs, table, n_pages = _sequences(layout, lens, seed=5)
    pages = layout.allocate(n_pages)
    for k, v, slots, pos in seqs:
        layout.write(pages, slots, k, v, pos)
    g = torch.Generator().manual_seed(6)
    # a window buffer of entries [layers, 2, C] (keys, values) for every token of every row, in shuffled order
    entries = sum(lens)
    store = torch.randn(entries, layers, 2, c, generator=g).half()
    where = torch.randperm(entries, generator=g)
    lens_t = torch.tensor(lens)
    first_entry = torch.cumsum(lens_t, 0) - lens_t
    pos = lens_t.view(-1, 1) - w + torch.arange(w).view(1, -1)  # [B, W]
    entry = where[(first_entry.view(-1, 1) + pos.clamp(min=0))]
    wk = store[entry, layer, 0].masked_fill((pos < 0).unsqueeze(-1), 0)
    wv = store[entry, layer, 1].masked_fill((pos < 0).unsqueeze(-1), 0)
    view, mask = layout.view(pages, table, lens_t, in_place=True)
    want = layout.with_window(view, wk, wv, lens_t)
    words = store.view(torch.int16).reshape(-1).numpy()
    starts = torch.where(pos < 0, -1, entry * layers * 2 * c).numpy()
    out = np.empty((2, len(lens), layout.sinks + w, c), np.int16)
    page_kernels.sinks_and_window(*layout.sink_regions(pages), table[:, 0].long().numpy(), words, starts,
                                  layer * 2 * c, c, out[0], out[1])
    both = torch.from_numpy(out).view(torch.float16)
    got = layout.with_window(view, both[0], both[1], lens_t, joined=True)
    for name in ("sink_k", "sink_v", "sink_slot"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    q = torch.randn(len(lens), 2 * (c // d), d, generator=g)
    rope = Rope.default(d)
    torch.testing.assert_close(decode_attention(q, got, rope, d**-0.5, key_mask=mask, backend="numba"),
                               decode_attention(q, want, rope, d**-0.5, key_mask=mask, backend="reference"),
                               rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match="with the sinks first"):
        layout.with_window(view, wk.float(), wv.float(), lens_t, joined=True)  # float32: not the joined rows
