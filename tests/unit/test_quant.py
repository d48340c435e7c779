"""Quantized linears: each CPU kernel against the dequantize-then-matmul reference, and GGUF's
4-bit blocks read as they are (checked against gguf-py's own dequantization)."""

from __future__ import annotations

import platform
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from services.scheduler import native
from services.scheduler.models import quant

# out x in: aligned (SmolLM2's o_proj, a multiple of 16 x 32) and odd on either side; 100 out
# is 7 tiles of 16, so from 16 rows two groups of three tiles and a group of one
SHAPES = [(576, 576), (48, 96), (33, 100), (7, 40), (5, 31), (100, 64)]
U = 2.0**-24  # float32's unit roundoff


def _magnitude(plain) -> torch.Tensor:
    """|scale * code| + |minimum| per weight [N, K]: what the kernels' partial sums are made of."""
    n = plain.codes.shape[0]
    codes = plain.codes.view(n, -1, 32).float()
    mag = (codes * plain.scale[..., None]).abs() + plain.minimum[..., None].abs()
    return mag.view(n, -1)[:, : plain.in_features]


def _check(out: torch.Tensor, x: torch.Tensor, plain) -> None:
    """`out` against x @ w.T (w the dequantized weight) within float32 summation error.

    The kernels form each dequantized weight exactly as the reference does (code * scale + min
    in one rounding) and sum K products in float32 in another order, or, below 4 rows, sum
    code * x per group of 32 and add scale * that + min * sum(x) per group. Either way each
    rounding error is at most u times a partial sum of terms |x_k| (|scale code_k| + |min|),
    and each term passes through at most Kp + G + 4 roundings (Kp = K padded to 32 G: the K-sum,
    or the group's 32 plus the G groups' sum, plus the products, the scale, the minimum and the
    chains' final sum), so |kernel - exact| <= (Kp + G + 4) u sum_k |x_k| mag_k elementwise
    (first order). The reference here is computed in float64 (the exact sum to ~1e-16): a wrong
    code, scale, lane or row moves results by a whole weight, far more."""
    w = plain.dequantize()
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    g = plain.scale.shape[1]
    exact = x.double() @ w.double().T
    bound = (32 * g + g + 4) * U * (x.double().abs() @ _magnitude(plain).double().T)
    excess = (out.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"max abs diff {(out.double() - exact).abs().max():.3g}"


# 1-3 rows: the factored register path (scale and minimum per group); 4-15: the register path
# (AVX2: dequantized buffers from 4 rows);
# 16 on: dequantized buffers, in blocks of 8 rows; 70 and 129 end on a block of 6 and of 1 rows
BATCHES = [1, 2, 3, 7, 16, 64, 70, 129]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", [quant.Int8Plain, quant.Int4Plain], ids=["int8", "int4"])
def test_kernel_matches_dequantize_reference(form, batch, shape):
    torch.manual_seed(batch)
    w = torch.randn(shape) * 0.05
    x = torch.randn(batch, shape[1])
    plain = form.quantize(w)
    kernel = plain.pack()
    # ours (the suite requires the C++ kernels to build)
    assert isinstance(kernel, {quant.Int8Plain: quant.Int8Linear,
                               quant.Int4Plain: quant.Int4Linear}[form])
    deq = plain.dequantize()
    assert deq.shape == w.shape
    _check(kernel.matmul(x), x, plain)
    # and the quantization itself is within half a step of each group's scale, plus the
    # minimum's rounding to float16 (2^-11 of it)
    step = plain.scale.repeat_interleave(32, dim=1)[:, : shape[1]]
    lo = plain.minimum.abs().repeat_interleave(32, dim=1)[:, : shape[1]]
    assert ((deq - w).abs() <= step / 2 + lo * 2**-11 + 1e-7).all()
    assert plain.codes.max() <= form.LEVELS


@pytest.fixture
def restore_small_calls():
    yield
    module = native.QUANT.module()
    module.set_one_thread_bytes(module.one_thread_bytes_default())


@pytest.mark.parametrize("form", [quant.Int8Plain, quant.Int4Plain], ids=["int8", "int4"])
def test_small_calls_on_one_thread_or_all_give_the_same_numbers(form, restore_small_calls):
    """1-3 row calls run on the calling thread or split by tiles over the pool (as
    calibrate_small_calls chose): each tile is the same arithmetic either way, bit for bit."""
    torch.manual_seed(5)
    kernel = form.quantize(torch.randn(200, 576) * 0.05).pack()
    module = native.QUANT.module()
    for batch in (1, 2, 3):
        x = torch.randn(batch, 576)
        assert module.set_one_thread_bytes(module.one_thread_bytes_default()) >= 0
        one = kernel.matmul(x)
        module.set_one_thread_bytes(0)
        split = kernel.matmul(x)
        assert torch.equal(one, split)
    with pytest.raises(RuntimeError, match="must be >= 0"):
        module.set_one_thread_bytes(-1)


def test_calibration_keeps_the_faster_setting_or_the_one_asked_for(restore_small_calls,
                                                                    monkeypatch):
    torch.manual_seed(6)
    layers = [quant.Int8Plain.quantize(torch.randn(512, 576) * 0.05).pack() for _ in range(4)]
    module = native.QUANT.module()
    # 1-3 rows run a path of their own on every build (the factored form), so there is always
    # something to time; from 4 rows (AVX2) or 16 (AVX-512, portable) tiles are dequantized
    assert module.dequant_rows() == (4 if module.float_isa() == "avx2" else 16)
    said = quant.calibrate_small_calls(layers, rounds=2)
    if torch.get_num_threads() > 1:
        # the numbers it measured, and the limit it left set is the one its words say
        one, every = (float(v) for v in
                      re.findall(r"one thread ([\d.]+) ms, all \d+ threads ([\d.]+) ms", said)[0])
        if one != every:  # printed to 0.01 ms: equal there, either may have been kept
            assert said.startswith("one thread" if one < every else "all threads")
    limit = module.set_one_thread_bytes(0)
    assert limit == (0 if said.startswith("all") else module.one_thread_bytes_default())
    monkeypatch.setenv("TOKENLINE_QUANT_SMALL_CALLS", "all")
    assert quant.calibrate_small_calls(layers) == "all threads (TOKENLINE_QUANT_SMALL_CALLS)"
    assert module.set_one_thread_bytes(0) == 0
    monkeypatch.setenv("TOKENLINE_QUANT_SMALL_CALLS", "one")
    assert quant.calibrate_small_calls(layers) == "one thread (TOKENLINE_QUANT_SMALL_CALLS)"
    assert module.set_one_thread_bytes(0) == module.one_thread_bytes_default()
    monkeypatch.delenv("TOKENLINE_QUANT_SMALL_CALLS")
    threads = torch.get_num_threads()
    module.set_one_thread_bytes(0)
    torch.set_num_threads(1)
    try:  # one torch thread: nothing to measure, and the log says why
        assert quant.calibrate_small_calls(layers) == "one thread (torch runs one thread)"
    finally:
        torch.set_num_threads(threads)
    assert module.set_one_thread_bytes(0) == module.one_thread_bytes_default() > 0
    monkeypatch.setenv("TOKENLINE_QUANT_SMALL_CALLS", "two")
    with pytest.raises(ValueError, match="auto, one or all"):
        quant.calibrate_small_calls(layers)


@pytest.mark.parametrize("batch", [1, 64])
def test_int4_kernel_with_float32_scales_matches_reference(batch):
    """Q4_K's d * sc do not fit float16: those layers keep float32 scales and minimums."""
    torch.manual_seed(3)
    n, k = 40, 64
    plain = quant.Int4Plain(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                            torch.rand(n, 2) * 1e-2 + 1e-3, -torch.rand(n, 2) * 1e-2, k)
    kernel = plain.pack()
    assert kernel.scale_min.dtype == torch.float32
    x = torch.randn(batch, k)
    _check(kernel.matmul(x), x, plain)


def test_kernels_take_bfloat16_activations_and_return_them():
    torch.manual_seed(4)
    w = torch.randn(48, 96) * 0.05
    x = torch.randn(7, 96).to(torch.bfloat16)
    for plain in (quant.Int8Plain.quantize(w), quant.Int4Plain.quantize(w)):
        out = plain.pack().matmul(x)
        assert out.dtype == torch.bfloat16
        ref = x.float() @ plain.dequantize().T  # summed in float32, rounded once to bfloat16
        bound = 2**-8 * (x.float().abs() @ plain.dequantize().abs().T) + 1e-6
        assert ((out.float() - ref).abs() <= bound).all()


def test_int8_embedding_rows_are_the_dequantized_rows():
    w = torch.randn(100, 64)
    plain = quant.Int8Plain.quantize(w)
    ids = torch.tensor([0, 99, 5, 5, 17])
    rows = plain.pack().rows(ids, torch.float32)
    assert torch.equal(rows, plain.dequantize()[ids])


def test_torch_fallback_kernels_match_reference_within_bfloat16():
    """Without a compiler torch's kernels run, with bfloat16 activations and per-row int8."""
    torch.manual_seed(5)
    w = torch.randn(48, 96) * 0.05
    x = torch.randn(7, 96)
    int8 = quant.TorchInt8Linear.quantize(w)
    int4 = quant.TorchInt4Linear.from_plain(quant.Int4Plain.quantize(w))
    deq4 = quant.Int4Plain.quantize(w).dequantize()
    xb = x.to(torch.bfloat16).double()
    for kernel, deq in ((int8, int8.q.float() * int8.scale.float()[:, None]), (int4, deq4)):
        out = kernel.matmul(x)
        bound = 2**-7 * (xb.abs() @ deq.double().abs().T)
        assert ((out.double() - xb @ deq.double().T).abs() <= bound).all()


def test_gguf_q8_0_blocks_read_as_gguf_dequantizes_them():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    plain = quant.int8_from_gguf(torch.from_numpy(raw), 96)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(plain.dequantize().numpy(), ref)
    assert plain.pack().scale_min.dtype == torch.float16  # Q8_0's d as it is


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
    # exact per-32 floats (d * sc in float32); float16 cannot hold all of them
    kernel = plain.pack()
    assert kernel.scale_min.dtype == torch.float32
    _check(kernel.matmul(torch.ones(1, 512)), torch.ones(1, 512), plain)


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
    weights.check("int8")  # int8 runs it (as it is)
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


def test_gguf_weights_read_q8_0_layers_for_int8(tmp_path):
    _write_gguf(tmp_path / "q8.gguf", "Q8_0")
    weights = quant.GGUFWeights(tmp_path / "q8.gguf", CONFIG)
    plain = weights.plain("layers.0.self_attn.q_proj", "int8")
    stored = quant.int8_from_gguf(torch.from_numpy(
        np.array(weights.tensors["blk.0.attn_q.weight"].data)), 64).dequantize()
    assert torch.equal(plain.dequantize(), stored.view(4, 8, 2, 64).transpose(1, 2).reshape(64, 64))
    assert weights.plain("layers.0.self_attn.q_proj", "int4") is None  # Q8_0 is not int4


def _check_float(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
    """A float32 tile matmul against x @ w.T (+ bias) in float64, within float32 summation
    error: each output is K products summed in float32 over at most 4 chains, then the chains
    and the bias added, so |kernel - exact| <= (K + 6) u sum_k |x_k w_k| (+ u |bias|). A wrong
    lane, row, tile or k moves a result by a whole product, far more."""
    exact = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact = exact + bias.double()
        mag = mag + bias.double().abs()
    assert out.dtype == torch.float32 and out.shape == exact.shape
    excess = (out.double() - exact).abs() - (w.shape[1] + 6) * U * mag
    assert excess.max().item() <= 0, f"max abs diff {(out.double() - exact).abs().max():.3g}"


# out x in with in a multiple of 4: aligned, a last tile of 1-15 channels, 1-2 tiles only
FLOAT_SHAPES = [(576, 576), (48, 96), (33, 100), (7, 40), (100, 64), (17, 1536)]


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 7, 8, 13, 16, 64, 70, 129])
@pytest.mark.parametrize("shape", FLOAT_SHAPES)
def test_float32_tiles_match_float64(shape, batch):
    """float32 weights in tiles (the projections on AVX-512 and AVX2 CPUs): every row count
    takes the groups of three tiles in blocks of 8 rows, ending on a block of 1-7 (AVX2 runs a
    block as 6 rows, then the 1-5 left; K in blocks of 64, 1536 has 24)."""
    n, k = shape
    torch.manual_seed(n * 1000 + k + batch)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(batch, k)
    lin = quant.Float32Tiles(w, None)
    assert lin.tiles.shape == (-(-n // 16), k, 16) and lin.nbytes == lin.tiles.nbytes
    _check_float(lin.matmul(x), x, w)


def test_float32_tiles_take_a_bias_strided_rows_and_other_dtypes():
    torch.manual_seed(3)
    w, b = torch.randn(40, 64) * 0.05, torch.randn(40)
    lin = quant.Float32Tiles(w, b)
    wide = torch.randn(19, 100)
    x = wide[:, 8:72]  # rows 100 floats apart: run as they lie
    assert x.stride() == (100, 1)
    _check_float(lin.matmul(x), x, w, b)
    x3 = torch.randn(2, 5, 64)
    out = lin.matmul(x3)
    assert out.shape == (2, 5, 40)
    _check_float(out.view(10, 40), x3.view(10, 64), w, b)
    xb = torch.randn(9, 64).bfloat16()
    out = lin.matmul(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (xb.float() @ w.T + b).bfloat16(), rtol=0, atol=0.02)
    assert lin.matmul(torch.randn(0, 64)).shape == (0, 40)


def test_float32_tiles_refuse_what_they_cannot_run(monkeypatch):
    module = native.QUANT.module()
    tiles = quant.Float32Tiles(torch.randn(16, 64), None).tiles
    with pytest.raises(RuntimeError, match="multiple of 4"):
        module.float_linear(torch.randn(2, 62), quant._tiles(torch.randn(16, 62)), None, 16)
    with pytest.raises(RuntimeError, match="x's K"):
        module.float_linear(torch.randn(2, 32), tiles, None, 16)
    with pytest.raises(RuntimeError, match="float32"):
        module.float_linear(torch.randn(2, 64).double(), tiles, None, 16)
    with pytest.raises(RuntimeError, match="N does not match"):
        module.float_linear(torch.randn(2, 64), tiles, None, 17)
    with pytest.raises(RuntimeError, match="bias"):
        module.float_linear(torch.randn(2, 64), tiles, torch.randn(15), 16)
    monkeypatch.delenv("TOKENLINE_FLOAT32_TILES", raising=False)
    from services.scheduler.native import cpu_flags

    missing = quant.float32_tiles_missing([576, 1536])
    flags = cpu_flags()
    if module.float_isa() != "portable":
        assert module.float_isa() == ("avx512" if module.vectorized() else "avx2")
        assert missing is None
        assert quant.float32_tiles_missing([576, 30]) == "input widths [30] are not multiples of 4"
    elif flags and "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        assert missing == "this CPU has neither AVX-512 nor AVX2 with FMA"
    else:
        assert missing == "the C++ matmul kernels were built without AVX-512 or AVX2"
    monkeypatch.setenv("TOKENLINE_FLOAT32_TILES", "0")
    assert quant.float32_tiles_missing([576]) == "TOKENLINE_FLOAT32_TILES=0"
    monkeypatch.setenv("TOKENLINE_FLOAT32_TILES", "off")
    with pytest.raises(ValueError, match="TOKENLINE_FLOAT32_TILES must be 0 or 1, not 'off'"):
        quant.float32_tiles_missing([576])


def _check_bf16(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor | None = None) -> None:
    """A bfloat16 tile matmul against x @ w.T (+ bias) in float64 from the same bfloat16
    values: K products summed in float32 (VDPBF16PS rounds after each product it adds) within
    (K + 6) u sum_k |x_k w_k| (+ u |bias|), then one rounding to bfloat16, at most 2^-8 of the
    float32 result. A wrong lane, row, tile or pair of k moves a result by a whole product."""
    xd, wd = x.double(), w.to(torch.bfloat16).double()
    exact = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if bias is not None:
        exact = exact + bias.double()
        mag = mag + bias.double().abs()
    f32_err = (w.shape[1] + 6) * U * mag
    bound = f32_err + 2.0**-8 * (exact.abs() + f32_err)
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    excess = (out.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"max abs diff {(out.double() - exact).abs().max():.3g}"


def _bf16_tiles_or_skip() -> None:
    missing = quant.bf16_tiles_missing([64])
    if missing:
        pytest.skip(f"no bfloat16 tiles here: {missing}")


# out x in with in a multiple of 8: aligned, a last tile of 1-15 channels, 1-2 tiles only
BF16_SHAPES = [(576, 576), (48, 96), (33, 104), (7, 40), (100, 64), (17, 1536)]


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13, 16, 64, 70])
@pytest.mark.parametrize("shape", BF16_SHAPES)
def test_bfloat16_tiles_match_float64(shape, batch):
    """bfloat16 weights in tiles with k in pairs (the bfloat16 projections' small calls on
    AVX512-BF16 CPUs): groups of three tiles, blocks of 8 rows ending on one of 1-7."""
    _bf16_tiles_or_skip()
    n, k = shape
    torch.manual_seed(n * 1000 + k + batch)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(batch, k).bfloat16()
    lin = quant.Bf16Tiles(w, None)
    assert lin.tiles.shape == (-(-n // 16), k // 2, 16, 2) and lin.nbytes == lin.tiles.nbytes
    _check_bf16(lin.matmul(x), x, w)


def test_bfloat16_tiles_take_a_bias_strided_rows_and_hand_large_calls_to_onednn():
    _bf16_tiles_or_skip()
    from services.scheduler.models.linear import onednn_pack

    torch.manual_seed(4)
    w, b = torch.randn(40, 64) * 0.05, torch.randn(40)
    lin = quant.Bf16Tiles(w, b)
    x = torch.randn(19, 100).bfloat16()[:, 8:72]  # rows 100 values apart: run as they lie
    assert x.stride() == (100, 1)
    _check_bf16(lin.matmul(x), x, w, b)
    x3 = torch.randn(2, 5, 64).bfloat16()
    out = lin.matmul(x3)
    assert out.shape == (2, 5, 40)
    _check_bf16(out.view(10, 40), x3.view(10, 64), w, b)
    xf = torch.randn(9, 64)  # float32 in: through bfloat16, float32 out
    out = lin.matmul(xf)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (xf.bfloat16().double() @ w.bfloat16().double().T
                                     + b.double()).float(), rtol=0.01, atol=0.02)
    assert lin.matmul(torch.randn(0, 64).bfloat16()).shape == (0, 40)
    # with a oneDNN copy, calls of more than `rows` rows go there (its bias in bfloat16, as
    # Linear.pack gives oneDNN): the same numbers to bfloat16
    both = quant.Bf16Tiles(w, b, onednn_pack(w, torch.bfloat16), rows=8)
    assert both.nbytes > lin.nbytes
    for rows in (8, 9, 40):
        xr = torch.randn(rows, 64).bfloat16()
        _check_bf16(both.matmul(xr), xr, w, b if rows <= 8 else b.bfloat16().float())


def test_bfloat16_tiles_refuse_what_they_cannot_run(monkeypatch):
    monkeypatch.delenv("TOKENLINE_BF16_TILES", raising=False)
    module = native.QUANT.module()
    from services.scheduler.native import cpu_flags

    missing = quant.bf16_tiles_missing([576, 1536])
    if not module.bf16_tiles_built():
        assert missing in ("this CPU has no AVX512-BF16",
                           "the C++ matmul kernels were built without AVX512-BF16")
        assert (missing == "this CPU has no AVX512-BF16") == ("avx512_bf16" not in cpu_flags())
        with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
            module.bf16_linear(torch.randn(2, 64).bfloat16(),
                               torch.zeros(1, 32, 16, 2, dtype=torch.bfloat16), None, 16)
    else:
        assert missing is None
        assert quant.bf16_tiles_missing([576, 36]) == "input widths [36] are not multiples of 8"
        tiles = quant.Bf16Tiles(torch.randn(16, 64), None).tiles
        x = torch.randn(2, 64).bfloat16()
        with pytest.raises(RuntimeError, match="multiple of 8"):
            module.bf16_linear(torch.randn(2, 36).bfloat16(),
                               torch.zeros(1, 18, 16, 2, dtype=torch.bfloat16), None, 16)
        with pytest.raises(RuntimeError, match="x's K"):
            module.bf16_linear(torch.randn(2, 32).bfloat16(), tiles, None, 16)
        with pytest.raises(RuntimeError, match="bfloat16"):
            module.bf16_linear(x.float(), tiles, None, 16)
        with pytest.raises(RuntimeError, match="N does not match"):
            module.bf16_linear(x, tiles, None, 17)
        with pytest.raises(RuntimeError, match="bias"):
            module.bf16_linear(x, tiles, torch.randn(16).bfloat16(), 16)
    monkeypatch.setenv("TOKENLINE_BF16_TILES", "0")
    assert quant.bf16_tiles_missing([576]) == "TOKENLINE_BF16_TILES=0"
    monkeypatch.setenv("TOKENLINE_BF16_TILES", "yes")
    with pytest.raises(ValueError, match="TOKENLINE_BF16_TILES must be 0 or 1, not 'yes'"):
        quant.bf16_tiles_missing([576])


def test_portable_kernels_match_reference():
    """The plain C++ path that machines without AVX512 build (CI may be AVX2 only), built here
    with AVX512 switched off: the same layout, the same numbers within float32 summation."""
    from tests.helpers import portable_build

    missing = native._toolchain_missing()
    if missing:
        pytest.skip(missing)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # -mno-avx512f exists on x86 only; elsewhere the suite's own build is the portable one
        pytest.skip(f"{platform.machine()}: no AVX512 to switch off")
    module = portable_build(native.QUANT.source, "the portable matmul kernels").module
    assert module is not None
    assert not module.vectorized()
    torch.manual_seed(6)
    for (n, k), batch in [((48, 96), 1), ((33, 100), 7), ((5, 31), 64), ((40, 64), 16),
                          ((50, 64), 3), ((17, 96), 70),
                          ((100, 64), 129)]:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(batch, k)
        for plain, fn in ((quant.Int8Plain.quantize(w), module.int8_linear),
                          (quant.Int4Plain.quantize(w), module.int4_linear)):
            packed = plain.pack()
            out = quant._native_matmul(fn, x, packed.tiles, packed.scale_min, n, k)
            _check(out, x, plain)
        if k % 4 == 0:  # the float32 tiles: AVX2 intrinsics here
            _check_float(module.float_linear(x, quant._tiles(w), None, n), x, w)
