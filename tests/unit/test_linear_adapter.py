"""The adapter slot beside Linear: whatever holds the base weight, the adapter's part is added."""

import pytest
import torch
from torch import nn

from services.scheduler.models.linear import Linear
from services.scheduler.models.quant import Int8Plain


class LowRank:
    """x @ A @ B * scale, added to the base output (a LoRA's shape)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        self.a, self.b, self.scale = a, b, scale

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out + (x @ self.a @ self.b) * self.scale


def make(bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=bias)
    return layer


@pytest.mark.parametrize("form", ["plain", "onednn", "tiles", "int8"])
def test_adapter_adds_its_part_to_every_weight_form(form):
    layer = make()
    x = torch.randn(5, 64)
    if form == "onednn":
        layer.pack()
    elif form == "tiles":
        from services.scheduler.models import quant
        if quant.float32_tiles_missing([64]):
            pytest.skip(f"no float32 tiles here: {quant.float32_tiles_missing([64])}")
        layer.pack(tiles=True)
    elif form == "int8":
        layer.quantized = Int8Plain.quantize(layer.weight.detach()).pack()
        layer.weight = None
    base = layer(x)
    a, b = torch.randn(64, 8), torch.randn(8, 48)
    layer.set_adapter(LowRank(a, b, 0.5))
    with_adapter = layer(x)
    torch.testing.assert_close(with_adapter, base + (x @ a @ b) * 0.5)
    assert not torch.allclose(with_adapter, base)  # it did change the output
    layer.set_adapter(None)
    torch.testing.assert_close(layer(x), base)


def test_an_nn_module_adapter_is_applied_and_not_registered():
    layer = make(bias=False)

    class Delta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(64, 4))
            self.b = nn.Parameter(torch.randn(4, 48))

        def forward(self, x, out):
            return out + x @ self.a @ self.b

    x = torch.randn(3, 64)
    base = layer(x)
    delta = Delta()
    layer.set_adapter(delta)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), base + x @ delta.a @ delta.b)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
