"""The paged layout against the HF path's store: same codes, the fixed key-outlier budget, any block table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvsqueeze.cache.store import KVStore
from kvsqueeze.kernels import decode_attention
from kvsqueeze.kernels.reference import dequantize_view
from kvsqueeze.paged.layout import PageLayout
from kvsqueeze.numerics.quantizer import VectorQuantizer
from kvsqueeze.numerics.rope import Rope


def _codebook(bits: int, g: torch.Generator) -> torch.Tensor:
    levels = torch.sort(torch.rand(2**bits, generator=g) * 2 - 1).values
    levels[0], levels[-1] = -1.0, 1.0
    return levels


def _quantizers(c: int, bits: int, fraction: float, seed: int = 0, slots: int = 0, widths: tuple = ()):
    """Key (per channel, offline range) and value (per token) quantizers with random codebooks; with `widths`,
    each channel of both takes one of those widths at random, with a codebook per width (a ':chan' budget)."""
    g = torch.Generator().manual_seed(seed)
    levels = _codebook(bits, g)
    lo, hi = -1.5 - torch.rand(c, generator=g), 1.0 + torch.rand(c, generator=g)
    kq = VectorQuantizer(levels=levels, axis="channel", fraction=fraction, lo=lo, hi=hi, slots=slots)
    vq = VectorQuantizer(levels=levels, axis="token", fraction=fraction)
    if widths:
        books = {w: _codebook(w, g) for w in widths}
        mixed = lambda q: dataclasses.replace(  # noqa: E731
            q, levels=books[max(widths)], codebooks=books,
            widths=torch.tensor(widths, dtype=torch.uint8)[torch.randint(len(widths), (c,), generator=g)])
        kq, vq = mixed(kq), mixed(vq)
    return kq, vq


def _fill(layout, lens, seed=0, garbage=True):
    """Sequences of `lens` tokens written into shuffled pages of a buffer full of random bytes."""
    g = torch.Generator().manual_seed(seed)
    c, bs = layout.channels, layout.block_size
    need = [-(-n // bs) for n in lens]
    pages = layout.allocate(sum(need) + 3)
    if garbage:
        pages.copy_(torch.randint(0, 256, pages.shape, generator=g, dtype=torch.uint8))
    order = torch.randperm(pages.shape[0], generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    seqs, used = [], 0
    for i, n in enumerate(lens):
        table[i, :need[i]] = order[used:used + need[i]]
        used += need[i]
        k = torch.randn(n, c, generator=g) * 0.8  # a few outliers past the ranges, some tokens over budget
        v = torch.randn(n, c, generator=g)
        seqs.append((k, v))
        pos = torch.arange(n)
        slots = table[i, pos // bs].long() * bs + pos % bs
        for chunk in torch.arange(n).split(5):  # in pieces, as prefill chunks and decode steps write
            layout.write(pages, slots[chunk], k[chunk], v[chunk], pos[chunk])
    return pages, table, seqs


@pytest.mark.parametrize("c, d, bits, fraction, sinks, key_slots, widths", [
    (64, 32, 3, 0.02, 1, 4, ()), (128, 64, 2, 0.01, 0, 3, ()), (96, 32, 4, 0.05, 2, 8, ()), (64, 64, 3, 0.0, 1, 0, ()),
    (96, 32, 3, 0.02, 1, 4, (1, 2, 3, 4, 5, 6)), (64, 64, 2, 0.0, 0, 0, (2, 3)),
])
def test_pages_hold_what_the_store_holds(c, d, bits, fraction, sinks, key_slots, widths):
    """Dequantized pages equal the HF path's store of the same quantizers bit for bit, whatever the block table
    (channels with widths of their own too); against a store keeping every outlier, a token within budget differs
    only where it keeps more exactly."""
    kq, vq = _quantizers(c, bits, fraction, slots=key_slots, widths=widths)
    plain_kq, _ = _quantizers(c, bits, fraction, widths=widths)
    layout = PageLayout(kq, vq, c, d, block_size=8, sinks=sinks)
    assert layout.key_slots == key_slots
    lens = [21, 8, 1, 13]
    pages, table, seqs = _fill(layout, lens)
    view, mask = layout.view(pages, table, torch.tensor(lens))
    pk, pv = dequantize_view(view)  # [T, B, C]
    counts = []
    for b, (k, v) in enumerate(seqs):
        n = lens[b]
        store = KVStore(kq, vq, c, sinks=sinks, head_dim=d)
        store.append(k[None], v[None])
        sk, sv = store.dequantize()
        torch.testing.assert_close(pk[:n, b], sk[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(pv[:n, b], sv[:, 0], rtol=0, atol=0)
        plain = KVStore(plain_kq, vq, c, sinks=sinks, head_dim=d)
        plain.append(k[None], v[None])
        qk = plain.dequantize()[0][:, 0]
        past = (k < kq.lo) | (k > kq.hi)
        fits = past.sum(1) <= key_slots if fraction > 0 else torch.ones(n, dtype=torch.bool)
        exact = pk[:n, b] == k.half().float()
        assert bool(((pk[:n, b] == qk) | exact)[fits].all())
        if key_slots:  # a token over budget keeps `key_slots` of its outliers exactly and clips the rest
            over = ~fits & (torch.arange(n) >= sinks)  # a sink is exact whole
            assert bool(((exact & past).sum(1)[over] == key_slots).all())
        counts.append((int(fits.sum()), int((~fits).sum())))
        assert bool(mask[b, :n].all()) and not bool(mask[b, n:].any())
        # whatever the pages held past a sequence is zeroed in the copy: finite keys, zero values
        assert bool(torch.isfinite(pk[n:, b]).all()) and not bool(pv[n:, b].any())
    within, over = map(sum, zip(*counts))
    assert within > 0 and (over > 0 or fraction == 0 or key_slots >= 8)  # both cases were checked


def test_decode_over_pages_numba_equals_reference_on_ragged_batches():
    c, d = 128, 64
    kq, vq = _quantizers(c, 3, 0.02, seed=3, slots=4)
    layout = PageLayout(kq, vq, c, d, block_size=16, sinks=1)
    lens = [70, 3, 33]
    pages, table, _ = _fill(layout, lens, seed=3)
    view, mask = layout.view(pages, table, torch.tensor(lens))
    q = torch.randn(len(lens), 6, d)
    rope = Rope.default(d)
    ref = decode_attention(q, view, rope, d**-0.5, key_mask=mask, backend="reference")
    fast = decode_attention(q, view, rope, d**-0.5, key_mask=mask, backend="numba")
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(fast, ref, rtol=2e-4, atol=2e-5)
    # each row alone, through its own one-row table, gives the same attention
    for b, n in enumerate(lens):
        one, m1 = layout.view(pages, table[b:b + 1], torch.tensor([n]))
        alone = decode_attention(q[b:b + 1], one, rope, d**-0.5, key_mask=m1, backend="reference")
        torch.testing.assert_close(alone, ref[b:b + 1], rtol=1e-5, atol=1e-6)


def test_overflow_is_counted_and_pages_are_fixed_size():
    c, d = 64, 32
    kq, vq = _quantizers(c, 2, 0.01, seed=5, slots=1)
    layout = PageLayout(kq, vq, c, d, block_size=4, sinks=0)
    pages = layout.allocate(2)
    k = torch.full((1, c), 5.0)  # every channel past its range: one kept, the rest clipped
    assert layout.write(pages, torch.tensor([0]), k, torch.randn(1, c), torch.tensor([0])) == c - 1
    assert layout.page_bytes % 16 == 0
    assert layout.page_bytes >= 4 * (2 * 2 * c // 8 + 4 + 4 * layout.value_slots + 4)


def test_bad_layouts_and_buffers_are_refused():
    kq, vq = _quantizers(64, 3, 0.01, slots=2)
    with pytest.raises(ValueError, match="first page"):
        PageLayout(kq, vq, 64, 32, block_size=4, sinks=5)
    with pytest.raises(ValueError, match="per-channel pre-RoPE keys"):
        PageLayout(vq, kq, 64, 32, block_size=4)
    with pytest.raises(ValueError, match="kslots"):
        PageLayout(_quantizers(64, 3, 0.01)[0], vq, 64, 32, block_size=4)
    layout = PageLayout(kq, vq, 64, 32, block_size=4)
    with pytest.raises(ValueError, match="uint8 \\[num_blocks"):
        layout.write(torch.zeros(3, 7, dtype=torch.uint8), torch.tensor([0]), torch.randn(1, 64), torch.randn(1, 64),
                     torch.tensor([0]))
    with pytest.raises(ValueError, match="past the"):
        layout.write(layout.allocate(1), torch.tensor([9]), torch.randn(1, 64), torch.randn(1, 64), torch.tensor([9]))


@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_values_beyond_float16_and_pages_outside_the_buffer_are_refused(kernels):
    """A bfloat16 engine can hand over values past float16's range, which a page's fp16 scale would store as
    inf (attention NaN); a block table naming a page past the buffer would have the compiled readers read outside
    it. Both are refused with what is wrong."""
    kq, vq = _quantizers(64, 3, 0.01, slots=2)
    layout = PageLayout(kq, vq, 64, 32, block_size=4, kernels=kernels)
    pages = layout.allocate(3)
    big = torch.randn(2, 64)
    big[1, 7] = 8e4
    for keys, values, name in ((torch.randn(2, 64), big, "values"), (big, torch.randn(2, 64), "keys"),
                               (torch.full((2, 64), float("nan")), torch.randn(2, 64), "keys")):
        with pytest.raises(ValueError, match=f"write: {name} reach .* beyond float16's 65,504"):
            layout.write(pages, torch.tensor([0, 1]), keys, values, torch.tensor([0, 1]))
    layout.write(pages, torch.arange(6), torch.randn(6, 64), torch.randn(6, 64), torch.arange(6))
    for in_place in (False, True):
        with pytest.raises(ValueError, match=r"names pages outside the buffer's 3: sequence 0 of 6 tokens reads "
                                             r"pages \[0, 3\]"):
            layout.view(pages, torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([6]), in_place=in_place)
        layout.view(pages, torch.tensor([[0, 1, 7]], dtype=torch.int32), torch.tensor([6]), in_place=in_place)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_window_given_beside_the_pages_is_read_as_the_hf_store_reads_its_own(in_place):
    """Decode attention over pages plus each row's fp16 window (`with_window`: the last W tokens' exact keys and
    values, from wherever an engine keeps them) equals attention over the HF store of a windowed method holding
    the same tokens, for rows longer and shorter than the window, with the numba kernel and the reference."""
    c, d, w, sinks = 64, 32, 8, 1
    kq, vq = _quantizers(c, 3, 0.02, seed=21, slots=4)
    layout = PageLayout(kq, vq, c, d, block_size=8, sinks=sinks)
    lens = [21, 3, 13]
    pages, table, seqs = _fill(layout, lens, seed=22)
    rope = Rope.default(d)
    q = torch.randn(len(lens), 4, d, generator=torch.Generator().manual_seed(23))
    view, mask = layout.view(pages, table, torch.tensor(lens), in_place=in_place)
    wk = torch.zeros(len(lens), w, c)
    wv = torch.zeros(len(lens), w, c)
    for b, (k, v) in enumerate(seqs):  # each row's positions n - W .. n - 1 (zeros where there is none)
        n = lens[b]
        take = torch.arange(n - w, n)
        ok = take >= 0
        wk[b, ok], wv[b, ok] = k[take[ok]], v[take[ok]]
    windowed = layout.with_window(view, wk, wv, torch.tensor(lens))
    plain_numba = decode_attention(q, view, rope, d**-0.5, key_mask=mask, backend="numba")
    for backend in ("reference", "numba"):
        got = decode_attention(q, windowed, rope, d**-0.5, key_mask=mask, backend=backend)
        for b, (k, v) in enumerate(seqs):
            store = KVStore(kq, vq, c, sinks=sinks, head_dim=d, window=w)
            store.append(k[None], v[None])
            want = decode_attention(q[b:b + 1], store.view(), rope, d**-0.5, backend="reference")
            torch.testing.assert_close(got[b:b + 1], want, rtol=2e-4, atol=2e-5)
    assert not torch.allclose(got, plain_numba, atol=1e-4)  # the window changes what the rows read


def test_a_step_memo_gives_every_layer_the_view_it_would_build_alone():
    """An engine's step builds one view per layer over the same block tables (`view(..., memo=)`): layers of other
    widths read the memo's slots and get, with their own pages and an fp16 window, the very attention a view
    built without the memo gives; other tables or lengths are not served from it."""
    c, d, w = 64, 32, 8
    first = PageLayout(*_quantizers(c, 3, 0.02, seed=31, slots=4), c, d, block_size=8, sinks=1)
    second = PageLayout(*_quantizers(c, 3, 0.02, seed=32, slots=2, widths=(2, 3, 4)), c, d, block_size=8, sinks=1)
    lens = torch.tensor([21, 3, 13])
    g = torch.Generator().manual_seed(33)
    q = torch.randn(3, 4, d, generator=g)
    wk, wv = torch.randn(3, w, c, generator=g), torch.randn(3, w, c, generator=g)
    rope = Rope.default(d)
    memo = {}
    pages = {}
    pages[first], table, _ = _fill(first, lens.tolist(), seed=34)
    pages[second], second_table, _ = _fill(second, lens.tolist(), seed=34)
    assert torch.equal(second_table, table)  # both layers' pages sit at the same places, as in an engine
    for layout in (first, second):
        alone, mask = layout.view(pages[layout], table, lens, in_place=True)
        shared, shared_mask = layout.view(pages[layout], table, lens, in_place=True, memo=memo)
        assert torch.equal(mask, shared_mask)
        want = decode_attention(q, layout.with_window(alone, wk, wv, lens), rope, d**-0.5, key_mask=mask)
        got = decode_attention(q, layout.with_window(shared, wk, wv, lens, memo=memo), rope, d**-0.5,
                               key_mask=shared_mask)
        assert torch.equal(got, want)
    assert len(memo) == 2  # one view entry and one window entry, read by the second layout
    other = lens.clone()
    other[1] = 5
    view, mask = first.view(pages[first], table, other, in_place=True, memo=memo)
    assert mask[1].sum() == 5 and view.tokens == 21
