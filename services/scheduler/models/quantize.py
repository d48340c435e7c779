"""A loaded model's projections, lm_head and embedding put into quantized weights (quant.py).

This walks the model's `Linear`s, so it sits above both the layers and the weight kinds: the
kinds know nothing of the model that holds them.
"""

from __future__ import annotations

import torch
from torch import nn

from common.logging import get_logger
from services.scheduler.models.layers import Linear
from services.scheduler.models.quant import (
    GGUFWeights,
    Int4Plain,
    Int8Plain,
    Plain,
    QuantSummary,
    calibrate_small_calls,
    native,
)

log = get_logger("quant")


def _matches(plain: Plain, weight: torch.Tensor) -> bool:
    """Whether `plain` dequantizes to `weight` (to float32 rounding), on every 16th row: a wrong
    name or row order moves nearly every row, and checking all of them doubles the load time."""
    rows = slice(None, None, 16)
    deq = plain.select(rows).dequantize()
    return deq.shape == weight[rows].shape and bool(
        (deq - weight[rows].float()).abs().max() <= 1e-6)


def _plain(name: str, weight: torch.Tensor, mode: str, gguf: GGUFWeights | None,
           summary: QuantSummary) -> Plain:
    """Layer `name` in `mode`: the file's own blocks where they map exactly, else quantized."""
    plain = gguf.plain(name, mode) if gguf is not None else None
    # the file's codes must give back the floats transformers read from it, or the name or row
    # mapping is off for this family: then quantize the floats instead
    if plain is not None and not _matches(plain, weight):
        log.warning(f"{name}: the GGUF's {mode} blocks do not match its float weights; "
                    "quantizing the floats at load")
        plain = None
    summary.from_file += plain is not None
    summary.at_load += plain is None
    if plain is None:
        plain = Int8Plain.quantize(weight) if mode == "int8" else Int4Plain.quantize(weight)
    return plain


def quantize_model(model: nn.Module, mode: str, gguf: GGUFWeights | None, *,
                   packed: bool) -> QuantSummary:
    """Quantize every projection (`mode`) and the lm_head and input embedding (int8).

    packed: run from the CPU kernels; else dequantize on load into the plain weights, in the
    model's dtype (CUDA: same numbers, no kernel). The lm_head and the embedding stay int8
    under int4 too, as llama.cpp's files keep them at 6-8 bits.
    """
    summary = QuantSummary(mode, kernel=("native" if native() else "torch") if packed
                           else "dequantized")
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight is None:
            continue
        weight = module.weight
        plain = _plain(name, weight, mode, gguf, summary)
        if packed:
            module.quantized = plain.pack()
            module.weight = None
        else:
            weight.data.copy_(plain.dequantize())
    embed = model.embed_tokens
    lm = _plain("embed_tokens" if model.lm_head is None else "lm_head", model.lm_weight,
                "int8", gguf, summary)
    embed_plain = None if model.lm_head is None else _plain("embed_tokens", embed.weight,
                                                            "int8", gguf, summary)
    if not packed:
        model.lm_weight.data.copy_(lm.dequantize())
        if embed_plain is not None:
            embed.weight.data.copy_(embed_plain.dequantize())
        return summary
    model.lm_quantized = lm.pack()
    model.embed_quantized = model.lm_quantized if embed_plain is None else embed_plain.pack()
    embed.weight = None
    if model.lm_head is not None:
        model.lm_head.weight = None
    if summary.kernel == "native":
        summary.small_calls = calibrate_small_calls(
            [m.quantized for m in model.modules() if isinstance(m, Linear) and
             m.quantized is not None] + [model.lm_quantized])
    return summary
