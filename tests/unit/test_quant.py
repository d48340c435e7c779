"""Quantized linears: each CPU kernel against the dequantize-then-matmul reference, and GGUF's
4-bit blocks read as they are (checked against gguf-py's own dequantization)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from services.scheduler import quant

# out x in: aligned (SmolLM2's o_proj, a multiple of 16 x 32) and odd on either side
SHAPES = [(576, 576), (48, 96), (33, 100), (7, 40), (5, 31)]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 from the bfloat16 activations the kernels take."""
    return x.to(quant.KERNEL_DTYPE).double() @ w.double().T


def _check(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within bfloat16's rounding: the output rounds to 8 bits of mantissa (half an ulp is 2^-9
    relative), the per-row scales too (2^-9), summed over K products of rounded terms."""
    bound = 2**-8 * (x.to(quant.KERNEL_DTYPE).double().abs() @ w.double().abs().T)
    assert out.dtype == x.dtype
    excess = (out.double() - ref).abs() - bound
    assert excess.max().item() <= 0, f"max abs diff {(out.double() - ref).abs().max():.3g}"


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kernel_matches_dequantize_reference(batch, shape):
    torch.manual_seed(batch)
    w = torch.randn(shape) * 0.05
    x = torch.randn(batch, shape[1])
    plain = quant.Int8Plain.quantize(w)
    kernel = plain.pack(quant.KERNEL_DTYPE)
    _check(kernel.matmul(x), _reference(x, plain.dequantize()), x, plain.dequantize())
    # and the quantization itself is within half a step of each row's scale
    assert ((plain.dequantize() - w).abs() <= plain.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_kernel_matches_dequantize_reference(batch, shape):
    torch.manual_seed(batch)
    w = torch.randn(shape) * 0.05
    x = torch.randn(batch, shape[1])
    plain = quant.Int4Plain.quantize(w)
    kernel = plain.pack(quant.KERNEL_DTYPE)
    deq = plain.dequantize()
    assert deq.shape == w.shape
    _check(kernel.matmul(x), _reference(x, deq), x, deq)
    step = plain.scale.repeat_interleave(32, dim=1)[:, : shape[1]]
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()


def test_int8_embedding_rows_are_the_dequantized_rows():
    w = torch.randn(100, 64)
    plain = quant.Int8Plain.quantize(w)
    ids = torch.tensor([0, 99, 5, 5])
    rows = plain.pack(quant.KERNEL_DTYPE).rows(ids, torch.float32)
    # the scale is held in bfloat16 (the kernels' dtype): one rounding of it per row
    ref = plain.dequantize()[ids]
    assert (rows - ref).abs().max() <= 2**-8 * ref.abs().max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_read_as_gguf_dequantizes_them(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = quants.quantize(w, qtype)
    plain = quant.int4_from_gguf(kind, torch.from_numpy(raw), 96)
    assert plain.codes.max() <= 15
    assert np.array_equal(plain.dequantize().numpy(), quants.dequantize(raw, qtype))


def test_gguf_q4_k_blocks_read_as_gguf_dequantizes_them():
    # gguf-py does not quantize Q4_K: random super-blocks (finite d and dmin) test every bit of
    # the 6-bit scale and min packing
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (16, 2 * 144), dtype=np.uint8)
    d = (rng.random((16, 2, 2)) * 0.01).astype(np.float16)
    raw.reshape(16, 2, 144)[..., 0:4] = d.view(np.uint8).reshape(16, 2, 4)
    plain = quant.int4_from_gguf("Q4_K", torch.from_numpy(raw), 512)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(plain.dequantize().numpy(), ref)


def _write_gguf(path, tensor_type: str) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    w = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    writer.add_tensor("blk.0.attn_q.weight", quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}


def test_int4_refuses_a_gguf_whose_layers_are_another_quantized_type(tmp_path):
    _write_gguf(tmp_path / "q8.gguf", "Q8_0")
    weights = quant.GGUFWeights(tmp_path / "q8.gguf", CONFIG)
    weights.check("int8")  # int8 runs it (requantized per row)
    with pytest.raises(ValueError, match="--quantization int4.*Q8_0"):
        weights.check("int4")


def test_gguf_weights_unpermute_llama_q_rows_as_transformers_does(tmp_path):
    _write_gguf(tmp_path / "q4.gguf", "Q4_1")
    weights = quant.GGUFWeights(tmp_path / "q4.gguf", CONFIG)
    weights.check("int4")
    plain = weights.int4("layers.0.self_attn.q_proj")
    stored = quant.int4_from_gguf("Q4_1", torch.from_numpy(
        np.array(weights.tensors["blk.0.attn_q.weight"].data)), 64).dequantize()
    # transformers' reverse_permute_weights
    ref = stored.view(4, 8, 2, 64).transpose(1, 2).reshape(64, 64)
    assert torch.equal(plain.dequantize(), ref)
    assert weights.int4("layers.0.mlp.down_proj") is None  # not in the file
