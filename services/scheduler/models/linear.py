"""The model's projections: one `Linear` whatever holds its weight (plain, a oneDNN copy,
float32 tiles or quantized codes), with a slot for an adapter beside it.

The weight kinds (models/quant.py) are handed to a Linear by `pack()` and by
models/quantize.py; none of them imports this module.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.models.quant import BF16_TILE_ROWS, Bf16Tiles, Float32Tiles, QuantizedWeight


def onednn_pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A [out, in] weight (cast to `dtype`) reordered for oneDNN's inner-product kernel (CPU).

    Why: torch runs a float32 F.linear through MKL, which on AMD CPUs takes a path about 2.5x
    slower than oneDNN's AVX-512 kernels (measured on an EPYC: 110 against 265 GFLOP/s per
    core). The result is float32 all the same, only summed in another order. A bfloat16 copy
    runs on AVX512-BF16 at about twice that again.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype))


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x @ packed.T (+ bias), computed in the packed weight's dtype, returned in x's."""
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "")
    return out.to(x.dtype)


def tiled_weight(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None,
                 rows: int = BF16_TILE_ROWS) -> Float32Tiles | Bf16Tiles:
    """Our tiles for a weight in `dtype` (default: its own): float32, or bfloat16 for calls of
    up to `rows` rows with a oneDNN copy (AMX where the CPU has it) for larger ones."""
    if (dtype or weight.dtype) == torch.bfloat16:
        return Bf16Tiles(weight, bias, onednn_pack(weight, torch.bfloat16), rows)
    return Float32Tiles(weight, bias)


class LinearAdapter(Protocol):
    """Something added to a projection's output from its input, such as a LoRA's low-rank
    x @ A @ B * scale: the slot where adapters go, beside the base weight whatever its kind."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of x) with the adapter's part added; may be in place."""
        ...


class Linear(nn.Linear):
    """nn.Linear that, once `pack()`ed, runs from a oneDNN copy of its weight or from float32
    tiles (CPU), or once given `quantized` weights (models/quant.py), from those; an `adapter`,
    when set, adds its part to whichever of them ran."""

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    tiled: Float32Tiles | Bf16Tiles | None = None
    quantized: QuantizedWeight | None = None
    adapter: LinearAdapter | None = None

    def pack(self, dtype: torch.dtype | None = None, tiles: bool = False) -> None:
        """Run from a oneDNN copy (or, with `tiles`, our tiles: float32, or bfloat16 with a
        oneDNN copy beside them for calls of many rows) from now on; the plain weight is freed
        (it would double the memory the projections hold)."""
        if tiles:
            self.tiled = tiled_weight(self.weight, self.bias, dtype)
        else:
            self.packed = onednn_pack(self.weight, dtype)
            self.packed_bias = None if self.bias is None else self.bias.detach().to(
                self.packed.dtype)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HOT_PATH (layers.py): one call per projection, so the base's kinds are inline here
        if self.quantized is not None:
            out = self.quantized.matmul(x)
            if self.bias is not None:
                out = out + self.bias
        elif self.tiled is not None:
            out = self.tiled.matmul(x)
        elif self.packed is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = onednn_linear(x, self.packed, self.packed_bias)
        return out if self.adapter is None else self.adapter(x, out)

    def set_adapter(self, adapter: LinearAdapter | None) -> None:
        """Put `adapter` in the slot (None empties it). Held as a plain attribute even when it
        is an nn.Module: registered as a submodule it would be shadowed by the class's None,
        and its parameters would join the base model's."""
        object.__setattr__(self, "adapter", adapter)
