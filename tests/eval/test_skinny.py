"""Few-row linear layers: the same products as `nn.Linear`, and every layer restored afterwards."""

import pytest
import torch
from torch import nn

from kvsqueeze.eval.skinny import MAX_ROWS, skinny_linears


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 80)
        self.b = nn.Linear(80, 24, bias=False)
        self.wide = nn.Linear(24, 8).to(torch.float64)  # another dtype: left alone

    def forward(self, x):
        return self.wide(self.b(torch.relu(self.a(x))).double())


@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 48), (2, 5, 48), (MAX_ROWS + 4, 48), (4, 0, 48)])
def test_skinny_products_equal_linear_and_layers_are_restored(shape):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(*shape)
    ref = net(x)
    with skinny_linears(net):
        assert "forward" in vars(net.a) and "forward" in vars(net.b) and "forward" not in vars(net.wide)
        got = net(x)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert all("forward" not in vars(m) for m in net.modules())


def test_layers_are_restored_when_the_block_raises():
    net = Net()
    with pytest.raises(RuntimeError, match="inside"):
        with skinny_linears(net):
            raise RuntimeError("inside")
    assert all("forward" not in vars(m) for m in net.modules())
