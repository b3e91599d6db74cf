"""kvsqueeze.numerics.turbo: TurboQuant's MSE quantizer (rotation, the sphere's Lloyd-Max levels, fp16 norms)."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze.methods import MethodError, average_bits, needs_recipe, parse_method
from kvsqueeze.numerics.turbo import TurboQuantizer, random_rotation, sphere_levels

# Lloyd-Max levels of the standard normal (Max 1960): a coordinate of a rotated unit vector in high
# dimension is about N(0, 1/D)
GAUSS = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3440, 2.1520]}


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_sphere_levels_approach_the_gaussian_lloyd_max_levels(bits):
    dim = 4096
    levels = sphere_levels(bits, dim).double() * math.sqrt(dim)
    assert torch.all(levels[1:] > levels[:-1])
    torch.testing.assert_close(levels, -levels.flip(0), atol=1e-6, rtol=0)  # symmetric
    torch.testing.assert_close(levels[2 ** (bits - 1):], torch.tensor(GAUSS[bits], dtype=torch.float64),
                               atol=0, rtol=5e-3)


def test_sphere_levels_are_the_centroids_of_their_cells():
    dim, bits = 64, 3
    levels = sphere_levels(bits, dim).double()
    g = torch.Generator().manual_seed(0)
    u = torch.randn(400_000, dim, generator=g, dtype=torch.float64)
    t = (u / u.norm(dim=1, keepdim=True))[:, 0].contiguous()  # one coordinate of uniform unit vectors
    cell = torch.bucketize(t, (levels[1:] + levels[:-1]) / 2)
    means = torch.stack([t[cell == i].mean() for i in range(2**bits)])
    torch.testing.assert_close(means, levels, atol=2e-3 / math.sqrt(dim) * 10, rtol=0)


def test_rotation_is_orthogonal_and_seeded():
    r = random_rotation(48, seed=3)
    torch.testing.assert_close(r @ r.T, torch.eye(48), atol=1e-5, rtol=0)
    assert torch.equal(r, random_rotation(48, seed=3)) and not torch.equal(r, random_rotation(48, seed=4))


@pytest.mark.parametrize("bits,bound", [(2, 0.117), (3, 0.030), (4, 0.009)])
def test_distortion_matches_the_paper_whatever_the_vectors(bits, bound):
    """TurboQuant's MSE per unit vector is about 0.117, 0.03, 0.009 at 2, 3, 4 bits (the paper's Theorem 1
    figures), for any input: random vectors and vectors dominated by one huge channel alike."""
    d, n = 128, 4000
    q = TurboQuantizer(bits, d, seed=1)
    g = torch.Generator().manual_seed(2)
    plain = torch.randn(n, d, generator=g)
    spiky = plain * 0.01  # each vector dominated by one channel, a different one for each
    rows = torch.arange(n)
    spiky[rows, rows % d] += 50.0 * torch.where(rows % 2 == 0, 1.0, -1.0)
    for x in (plain, spiky):
        xq, kept = q.fake(x)
        assert kept == 0
        rel = ((xq - x).pow(2).sum(1) / x.pow(2).sum(1)).mean()
        assert bound * 0.85 < float(rel) < bound * 1.15, (bits, float(rel))


def test_split_gives_the_prompts_high_rms_half_one_more_bit():
    d, heads = 16, 2
    q = TurboQuantizer(2, d, seed=5, split=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, heads * d, generator=g)
    loud = [1, 3, 4, 8, 9, 10, 12, 15]
    x.view(64, heads, d)[:, 0, loud] *= 20
    q.fake(x)
    assert sorted(q._outliers[0].nonzero().view(-1).tolist()) == loud
    assert q.avg_code_bits == 2.5
    later = torch.randn(8, heads * d, generator=g)
    before = q._outliers.clone()
    q.fake(later)
    assert torch.equal(q._outliers, before)  # chosen once per cache
    q.reset()
    q.fake(later)
    assert not torch.equal(q._outliers[0], before[0])
    # each half is its own TurboQuant instance: better than 2 bits for the loud channels
    err_split = (TurboQuantizer(2, d, 5, split=True).fake(x)[0] - x).pow(2).mean()
    err_plain = (TurboQuantizer(2, d, 5).fake(x)[0] - x).pow(2).mean()
    assert err_split < err_plain


def test_turbo_method_names_and_bits():
    spec = parse_method("turbo3")
    assert (spec.family, spec.k_bits, spec.key_rope, spec.sinks, needs_recipe(spec)) == ("turbo", 3, "post", 0, False)
    assert parse_method("turbo2:split").name == "turbo2:split" and parse_method("turbo2:split").split
    assert average_bits(spec, 1, 128, 64, 1000) == pytest.approx(3 + 16 / 64)
    assert average_bits(parse_method("turbo3:split"), 1, 128, 64, 1000) == pytest.approx(3.5 + 2 * 16 / 64)
    with pytest.raises(ValueError, match="head dimension"):
        average_bits(spec, 1, 128, 48, 1000)
    for bad, match in (("turbo3-1%", "no outlier option"), ("turbo3:kchan", "fixed axes"),
                       ("nuq3:split", "turbo's outlier half")):
        with pytest.raises(MethodError, match=match):
            parse_method(bad)


def test_turbo_runs_in_the_simulation_and_is_refused_by_the_compressed_cache(tiny_llama):
    import kvsqueeze
    from conftest import random_ids
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    ids = random_ids(1, 48, seed=4)
    with torch.no_grad():
        own = tiny_llama(ids).logits
        errs = {}
        # bits per element, head_dim 16: the code bits (a split head: half its channels one bit wider) and an
        # fp16 norm per head vector (a split head: one per half)
        expected = {"turbo2": 2 + 16 / 16, "turbo2:split": 2.5 + 2 * 16 / 16, "turbo4": 4 + 16 / 16}
        for name, per_element in expected.items():
            with SimulatedQuantization(tiny_llama, parse_method(name), None) as sim:
                got = tiny_llama(ids, cache=sim.new_cache(), use_cache=True).logits
                bits = sim.storage(48)
            errs[name] = float((got - own).abs().mean())
            assert 8 * sum(bits.values()) / (2 * 48 * 32 * 2) == pytest.approx(per_element)
    assert errs["turbo4"] < errs["turbo2:split"] < errs["turbo2"]
    with pytest.raises(MethodError, match="turbo stores rotated head vectors"):
        kvsqueeze.cache_for(tiny_llama, None, "turbo3")


def test_turbo_through_the_eval_command(tiny_model_dir, text_file, tmp_path):
    import json

    from kvsqueeze.cli import main

    js = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--text", str(text_file), "--methods",
                 "fp16,turbo3,turbo2:split", "--seqlen", "64", "--max-windows", "2", "--json", str(js)]) == 0
    rows = {r["method"]: r for r in json.loads(js.read_text())["rows"]}
    assert rows["turbo3"]["avg_bits"] == pytest.approx(3 + 16 / 16) and rows["turbo2:split"]["kld_mean"] > 0
