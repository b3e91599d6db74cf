"""A rank's share of a layer's pages (tensor parallelism): its heads of exactly what the whole layout holds.

Each rank is given every head's keys and values of the new tokens and keeps its own heads: their codes, each
token's value scale and zero-point, and the token's fixed count of exact key and value elements, those that lie in
other ranks' heads marked empty (`NO_CHANNEL`). So the shares of all ranks together hold the whole layout's
pages, bit for bit, and attention over a share is the whole layout's for the rank's query heads.
"""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.kernels import decode_attention
from kvsqueeze.kernels.numba.dequant import dequantize_view as numba_dequantize_view
from kvsqueeze.kernels.reference import dequantize_view
from kvsqueeze.kernels.view import NO_CHANNEL
from kvsqueeze.numerics.rope import Rope
from kvsqueeze.paged.layout import PageLayout

from test_page_kernels import _sequences
from test_pages import _quantizers

CASES = [  # channels, head_dim, bits, outlier fraction, sinks, key slots, block size, widths
    (64, 32, 3, 0.02, 1, 4, 8), (96, 32, 4, 0.05, 2, 8, 8), (160, 32, 1, 0.03, 3, 5, 4),
    (256, 64, 3, 0.01, 1, 6, 16), (96, 32, 3, 0.02, 1, 4, 8, (1, 2, 3, 4, 5, 6)), (128, 64, 2, 0.0, 0, 0, 16, (2, 3)),
]


def _shares(heads: int) -> list[tuple[int, int]]:
    """Two ranks' shares of the heads (the first takes the larger half)."""
    first = -(-heads // 2)
    return [(0, first), (first, heads - first)]


def _layouts(case, kernels="torch", seed=0):
    c, d, bits, fraction, sinks, key_slots, bs, *widths = case
    kq, vq = _quantizers(c, bits, fraction, seed=seed, slots=key_slots, widths=tuple(widths[0]) if widths else ())
    make = lambda heads: PageLayout(kq, vq, c, d, block_size=bs, sinks=sinks, kernels=kernels,  # noqa: E731
                                    heads=heads)
    return make(None), [make(h) for h in _shares(c // d)]


def _written(layout, seqs, n_pages, seed):
    """A buffer of random bytes with every sequence written into it, in chunks as prefill and decode write."""
    pages = layout.allocate(n_pages)
    pages.copy_(torch.randint(0, 256, pages.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    for k, v, slots, pos in seqs:
        for chunk in torch.arange(len(pos)).split(7):
            layout.write(pages, slots[chunk], k[chunk], v[chunk], pos[chunk])
    return pages


def _slot_entries(layout, pages, side, slots):
    """(channels int64, values as int16 bits) of the exact elements of the given slots: [N, count] each."""
    ch = layout.region(pages, f"{side}_channels").reshape(-1, layout.regions[f"{side}_channels"].shape[1])
    val = layout.region(pages, f"{side}_values").reshape(-1, layout.regions[f"{side}_values"].shape[1])
    return ch[slots].long() & 0xFFFF, val[slots].view(torch.int16)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_shares_hold_their_heads_of_the_whole_layouts_pages(case, kernels):
    full, shares = _layouts(case, kernels)
    lens = [29, 1, 3 * full.block_size + 2]
    seqs, table, n_pages = _sequences(full, lens, seed=1)
    pages = _written(full, seqs, n_pages, seed=2)
    whole = [full.read(pages, table[b], n) for b, n in enumerate(lens)]
    slots = torch.cat([s for _, _, s, _ in seqs])
    held = {side: [] for side in ("k", "v") if getattr(full, "key_slots" if side == "k" else "value_slots")}
    for share in shares:
        c0, c1 = share.first_channel, share.first_channel + share.channels
        assert share.channels == share.heads * share.head_dim and share.full_channels == full.channels
        assert share.page_bytes < full.page_bytes
        mine = _written(share, seqs, n_pages, seed=3)
        for b, n in enumerate(lens):  # codes, scales, exact elements and sinks: the floats they give, bit for bit
            k, v = share.read(mine, table[b], n)
            assert torch.equal(k, whole[b][0][:, c0:c1]) and torch.equal(v, whole[b][1][:, c0:c1]), (share.heads, b)
        assert torch.equal(share.region(mine, "v_scale_zero").reshape(-1, 2)[slots].view(torch.int16),
                           full.region(pages, "v_scale_zero").reshape(-1, 2)[slots].view(torch.int16))
        for side in held:
            ch, val = _slot_entries(share, mine, side, slots)
            named = ch != NO_CHANNEL
            assert (ch[named] < share.channels).all() and (val[~named] == 0).all()
            assert (named.cumsum(1) == torch.arange(1, ch.shape[1] + 1).clamp(max=named.sum(1, keepdim=True))).all()
            assert not named.all()  # some of a token's exact elements lie in the other share's heads
            held[side].append(torch.where(named, ch + c0, -1))  # the share's entries as the whole token's channels
    for side, parts in held.items():  # the shares together: every exact element of the whole layout, once
        ch, _ = _slot_entries(full, pages, side, slots)
        together = torch.cat(parts, dim=1)
        together = together.sort(dim=1).values[:, -ch.shape[1]:]
        assert torch.equal(together, ch.sort(dim=1).values), side
        assert ((torch.cat(parts, dim=1) >= 0).sum(1) == ch.shape[1]).all()


@pytest.mark.parametrize("case", CASES)
def test_numba_writes_the_share_torch_writes(case):
    _, torch_shares = _layouts(case, "torch")
    _, fast_shares = _layouts(case, "numba")
    full, _ = _layouts(case)
    seqs, _, n_pages = _sequences(full, [37, 2 * case[6] + 3], seed=4)
    for ref, fast in zip(torch_shares, fast_shares):
        assert torch.equal(_written(ref, seqs, n_pages, seed=5), _written(fast, seqs, n_pages, seed=5))


@pytest.mark.parametrize("case", CASES)
def test_attention_over_a_share_is_the_whole_layouts_for_its_heads(case, monkeypatch):
    """Decode attention of a rank's query heads over its share, read in place (numba, Triton) or gathered (the
    reference), equals the whole layout's attention for those heads; so does dequantizing the share."""
    full, shares = _layouts(case, seed=6)
    c, d, bs = case[0], case[1], case[6]
    lens = [3 * bs + 5, 1, bs, 2]
    seqs, table, n_pages = _sequences(full, lens, seed=7)
    pages = _written(full, seqs, n_pages, seed=8)
    g = 2  # query heads per KV head
    q = torch.randn(len(lens), g * (c // d), d, generator=torch.Generator().manual_seed(9))
    rope, lens_t = Rope.default(d), torch.tensor(lens)
    view, mask = full.view(pages, table, lens_t)
    want = decode_attention(q, view, rope, d**-0.5, key_mask=mask, backend="reference")
    k_all, v_all = dequantize_view(view)
    for share in shares:
        c0, c1 = share.first_channel, share.first_channel + share.channels
        heads = slice(c0 // d * g, c1 // d * g)
        mine = _written(share, seqs, n_pages, seed=10)
        qs = q[:, heads].contiguous()
        gathered, m = share.view(mine, table, lens_t)
        paged, _ = share.view(mine, table, lens_t, in_place=True)
        ref = decode_attention(qs, gathered, rope, d**-0.5, key_mask=m, backend="reference")
        torch.testing.assert_close(ref, want[:, heads], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(decode_attention(qs, paged, rope, d**-0.5, key_mask=m, backend="numba"),
                                   want[:, heads], rtol=2e-4, atol=2e-5)
        k, v = numba_dequantize_view(paged.gathered())
        live = m.t()  # [T, B]
        assert torch.equal(k[live], k_all[:, :, c0:c1][live]) and torch.equal(v[live], v_all[:, :, c0:c1][live])
        if bs <= 8:  # Triton (its interpreter here) over the share in place
            torch.testing.assert_close(decode_attention(qs, paged, rope, d**-0.5, key_mask=m, backend="triton"),
                                       want[:, heads], rtol=2e-4, atol=2e-5)


def test_shares_that_are_not_heads_and_tokens_of_one_share_are_refused():
    kq, vq = _quantizers(64, 3, 0.02, slots=4)
    for heads in [(1, 2), (0, 0), (-1, 1), (2, 1)]:
        with pytest.raises(ValueError, match="not a share of the 2 KV heads"):
            PageLayout(kq, vq, 64, 32, block_size=8, heads=heads)
    share = PageLayout(kq, vq, 64, 32, block_size=8, heads=(1, 1))
    pages = share.allocate(2)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match=r"\[N, 64\] \(every KV head's\)"):
        share.write(pages, torch.arange(3), x, x, torch.arange(3))
