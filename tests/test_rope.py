"""kvsqueeze.numerics.rope: one rotation for every path, at full or half width, and its inverse."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.numerics.rope import Rope, apply_rope, rotate_half, unapply_rope


def test_half_and_full_width_angles_give_the_same_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 64, generator=g)
    cos, sin = Rope.default(64).cos_sin(torch.arange(17))  # [T, D/2]
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # transformers' convention
    assert torch.equal(apply_rope(x, cos, sin), apply_rope(x, full_cos, full_sin))
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    assert torch.equal(apply_rope(x, cos, sin), torch.cat([a * cos - b * sin, b * cos + a * sin], -1))


def test_unapply_inverts_apply_and_rotation_keeps_norms():
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in Rope.default(32, theta=500_000.0).cos_sin(torch.arange(9) * 1000))
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(unapply_rope(y, cos, sin), x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


@pytest.mark.parametrize("scaling, half", [(1.0, 16), (1.3, 16), (0.8, 8)])
def test_unapply_inverts_apply_scaled_and_partial(scaling, half):
    from kvsqueeze.numerics.rope import Rope

    g = torch.Generator().manual_seed(1)
    rope = Rope(torch.rand(half, generator=g), scaling)
    x = torch.randn(3, 50, 32, generator=g)
    pos = torch.arange(100, 150)
    torch.testing.assert_close(rope.unapply(rope.apply(x, pos), pos), x, rtol=1e-5, atol=1e-5)


def test_unapply_by_float32_angles_inverts_keys_turned_by_float32_angles():
    """An engine that caches cos / sin from float32 angles (vLLM) turned its keys by those: turning back by the
    same angles recovers them to float rounding; by the float64 angles it leaves a residual rotation."""
    g = torch.Generator().manual_seed(2)
    rope = Rope.default(64, theta=100_000.0)
    x = torch.randn(3, 40, 64, generator=g)
    pos = torch.arange(4000, 4040)
    ang = pos.float().unsqueeze(-1) * rope.inv_freq  # float32, as such an engine computes them
    y = apply_rope(x, ang.cos(), ang.sin())
    exact = (rope.unapply(y, pos, float32_angles=True) - x).abs().max()
    residual = (rope.unapply(y, pos) - x).abs().max()
    assert exact < 1e-5 < residual
