"""nuq with an fp16 window of recent tokens (`:rN`): names, bits, budgets and the simulated path."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids
from kvsqueeze.budget import TOKENS, allocate, allocate_channels, layer_storage_bits
from kvsqueeze.integrations.cache import cache_for
from kvsqueeze.integrations.kivi import mixed_attention
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import MethodError, parse_method, storage_bits
from kvsqueeze.shape import kv_shape


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
    assert windowed["total"] - plain["total"] == 2 * 16 * 64 * 16
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
    total = sum(layer_storage_bits(spec, tiny_recipe, i, TOKENS, channels)["total"] for i in range(int(fp["layers"])))
    assert total / (2 * TOKENS * channels * int(fp["layers"])) == pytest.approx(windowed.bits, rel=1e-9)


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
    assert st["fp16_window"] == shape.layers * 2 * 16 * shape.channels * 16


def test_compressed_cache_refuses_a_window_it_does_not_hold(tiny_llama, tiny_recipe):
    with pytest.raises(MethodError, match="fp16"):
        cache_for(tiny_llama, tiny_recipe, "nuq3-1%:r16")
