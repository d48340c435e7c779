"""The C++ fused ops (services/scheduler/native/ops_cpu.cpp) against the torch ops they replace.

float32: how far each op moves from the torch path it replaced is asserted below (sums run in
another order, and the rotary's products may fuse into one multiply-add: a few float32 ulps).
bfloat16: every op computes in float32 and rounds once, so each result is within half a
bfloat16 ulp of the exact (float64) answer, plus the float32 error before the rounding.
Sizes: aligned (multiples of the 16-lane AVX-512 loop) and odd ones (the scalar tails).
Each kernel test runs on the suite's build and on the portable one (AVX-512 switched off: what
an AVX2-only CI machine builds); rows enough to cross the threads' threshold (kParallelWork)
run split as well as inline.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from services.scheduler import native
from services.scheduler.models.layers import RMSNorm, Rotary
from services.scheduler.native import ops as fused
from tests.helpers import portable_build

native_ops = native.OPS.module()
pytestmark = pytest.mark.skipif(native_ops is None,
                                reason=f"no C++ toolchain: {native.OPS.kernels()}")
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module", params=["native", "portable"])
def ops(request):
    """The suite's build, or the same source built with -mno-avx512f (its own build)."""
    if request.param == "native":
        return native_ops
    if not X86:  # -mno-avx512f is an x86 flag; elsewhere the native build is the portable one
        pytest.skip(f"{platform.machine()}: no AVX-512 to switch off")
    module = portable_build(native.OPS.source, "the portable fused ops").module
    assert module is not None and module.isa() != "avx512"
    return module

def test_the_build_runs_the_vector_loops_this_cpu_has():
    """-march=native: AVX-512's loops where the CPU has F, BW and VL, else AVX2's where it
    has AVX2 and FMA (the AVX2 EPYCs), else the portable ones; the start-up log names which."""
    flags = native.cpu_flags()
    want = ("avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags
            else "avx2" if {"avx2", "fma"} <= flags else "portable")
    assert native_ops.isa() == want


SIZES = [1, 7, 16, 61, 64, 576, 1000]  # row widths: odd, aligned, SmolLM2's hidden
ROWS = [1, 7, 64]


def within_bf16_rounding(got: torch.Tensor, exact: torch.Tensor, slack: float = 1e-5) -> None:
    """got (bf16) is the exact value rounded to nearest: within half an ulp (2^-8 relative),
    plus float32's error before the rounding."""
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0**-8 * (1 + 1e-3) + slack * (1 + exact.abs())
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def exact_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", SIZES)
def test_add_rms_norm_float32_matches_torch(ops, rows, n):
    torch.manual_seed(n * 100 + rows)
    residual, x, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    ref_res = residual + x
    ref = F.rms_norm(ref_res, (n,), w, 1e-5)
    out = ops.add_rms_norm_(residual, x, w, 1e-5)
    assert out.data_ptr() == x.data_ptr()  # written over x
    assert torch.equal(residual, ref_res)  # the residual add is the same float32 add
    # the norm sums squares in another order: measured 1.4e-6 at most on these sizes (values
    # of up to ~4: a few float32 ulps)
    assert (out - ref).abs().max().item() < 4e-6


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", SIZES)
def test_add_rms_norm_bfloat16_rounds_once(ops, n, weight_dtype):
    torch.manual_seed(n)
    residual = torch.randn(64, n).bfloat16()
    x = torch.randn(64, n).bfloat16()
    w = torch.randn(n).to(weight_dtype)
    ref_res = residual + x  # torch's bf16 add: float32 sum, rounded
    out = ops.add_rms_norm_(residual, x, w, 1e-6)
    assert torch.equal(residual, ref_res)
    within_bf16_rounding(out, exact_norm(ref_res, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 64, 80, 256])
def test_rms_norm_over_heads_in_place_and_strided(ops, dtype, n):
    """q and k norms (Qwen3, Gemma 3): [T, H, D] views inside a wider row, normed in place,
    and nothing outside the view touched."""
    torch.manual_seed(n)
    rows = torch.randn(9, 5 * n).to(dtype)
    before = rows.clone()
    view = rows[:, n : 4 * n].view(9, 3, n)
    w = torch.randn(n).to(dtype)
    ref = F.rms_norm(view.float(), (n,), w.float(), 1e-6)
    exact = exact_norm(view, w, 1e-6)
    ops.rms_norm_(view, w, 1e-6, view)
    assert torch.equal(rows[:, :n], before[:, :n]) and torch.equal(rows[:, 4 * n:],
                                                                    before[:, 4 * n:])
    if dtype == torch.float32:  # measured 9.5e-7 at most
        assert (view - ref).abs().max().item() < 2e-6
    else:
        within_bf16_rounding(view, exact)


def test_rms_norm_module_float32_moves_little(tiny_rows=33):
    """RMSNorm.forward on the C++ path against its own torch path (F.rms_norm)."""
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(tiny_rows, 576) * 3
    fused = norm(x)
    assert (fused - norm._torch(x)).abs().max().item() < 5e-6  # measured 1.4e-6


def rotary_reference(x: torch.Tensor, positions: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """The torch path (Rotary.rotate_ on tables looked up by position), in x's dtype."""
    out = x.clone()
    Rotary.rotate_(out, rot.tables(positions, x.dtype))
    return out


def rotary_exact(x: torch.Tensor, positions: torch.Tensor, rot: Rotary) -> torch.Tensor:
    c = rot.cos.double()[positions][:, None, :]
    s = rot.sin.double()[positions][:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [6, 32, 64, 80, 256])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_rotary_on_q_and_k_in_one_call(ops, dtype, head_dim, tokens):
    """q and k heads inside a qkv row, rotated in place by position; v untouched."""
    torch.manual_seed(head_dim + tokens)
    hq, hkv = 9, 3
    rot = Rotary({"rope_type": "default", "rope_theta": 10000.0}, head_dim, 4096)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim).to(dtype)
    heads = qkv.view(tokens, hq + 2 * hkv, head_dim)
    qk = heads[:, : hq + hkv]
    v_before = heads[:, hq + hkv:].clone()
    positions = torch.randint(0, 4096, (tokens,))
    ref = rotary_reference(qk, positions, rot)
    exact = rotary_exact(qk, positions, rot)
    ops.rotary_(heads, hq + hkv, positions, rot.cos, rot.sin)
    assert torch.equal(heads[:, hq + hkv:], v_before)
    if dtype == torch.float32:
        # the same products, rounded where torch rounds them or fused into a multiply-add:
        # measured 4.8e-7 at most against the torch path
        assert (qk - ref).abs().max().item() < 2e-6
    else:
        within_bf16_rounding(qk, exact)


def test_rotary_refuses_positions_outside_the_table(ops):
    rot = Rotary({"rope_type": "default", "rope_theta": 10000.0}, 64, 16)
    x = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rotary_(x, 4, torch.tensor([3, 16]), rot.cos, rot.sin)
    with pytest.raises(RuntimeError, match="heads 5 of 4"):
        ops.rotary_(x, 5, torch.tensor([3, 1]), rot.cos, rot.sin)


ACTS = {"silu": ("silu_and_mul", F.silu),
        "gelu_pytorch_tanh": ("gelu_tanh_and_mul", lambda g: F.gelu(g, approximate="tanh"))}


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1, 13, 16, 61, 1536])
def test_act_and_mul_float32_matches_torch(ops, activation, rows, inter):
    torch.manual_seed(inter + rows)
    name, act = ACTS[activation]
    fused = getattr(ops, name)
    gu = torch.randn(rows, 2 * inter) * 4
    gu[0, :2] = torch.tensor([-200.0, 200.0])[: min(2, inter)] if inter > 1 else -200.0
    gate, up = gu.chunk(2, dim=-1)
    ref = act(gate) * up
    out = fused(gu)
    assert out.shape == (rows, inter) and out.is_contiguous()
    # exp and the tanh (as exp) computed otherwise than torch's: measured 1.6e-7 at most,
    # relative to the row's largest value; gates of +-200 (exp would overflow) saturate as
    # torch's do
    assert (out - ref).abs().max().item() < 1e-6 * (1 + ref.abs().max().item())


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("inter", [13, 64, 1536])
def test_act_and_mul_bfloat16_rounds_once(ops, activation, inter):
    torch.manual_seed(inter)
    name, act = ACTS[activation]
    fused = getattr(ops, name)
    gu = (torch.randn(7, 2 * inter) * 4).bfloat16()
    gate, up = gu.double().chunk(2, dim=-1)
    within_bf16_rounding(fused(gu), act(gate) * up, slack=1e-5)


def test_act_and_mul_reads_strided_rows(ops):
    """An int4 matmul's output is a slice of a wider one: rows with a larger stride."""
    wide = torch.randn(5, 40)
    gu = wide[:, :32]
    ref = F.silu(gu[:, :16]) * gu[:, 16:]
    assert (ops.silu_and_mul(gu) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul_over_the_whole_exp_range(ops, activation, dtype):
    """Gates from -120 to 120 (exp's argument clamped past +-80: silu and tanh saturated
    there) against the float64 answer. float32: within 4e-7 relative (measured 3.3e-7, at
    gates near -52); gelu's 1 + tanh(u) is 2e / (e + 1), e = exp(2u), which does not cancel
    for negative gates (2 - 2 / (e + 1) did: it was allowed 2^-20 of 0.5 g up there), so it is
    held to a relative bound too, widened by float32's rounding of the argument 2u (about
    |2u| 2^-24, which exp turns into that much relative error: measured at most 0.71 of the
    bound on an AVX2 EPYC, vector loop and scalar tail); bf16: rounded once."""
    name, act = ACTS[activation]
    gate = torch.linspace(-120, 120, 4801)
    gu = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    g = gate.double()
    # the float64 reference as g sigmoid(2u): float64's own 1 + tanh(u) cancels to 0 too
    exact = (g * torch.sigmoid(1.5957691216057308 * (g + 0.044715 * g**3))
             if activation == "gelu_pytorch_tanh" else act(g)) * up.double()
    out = getattr(ops, name)(gu)
    if dtype == torch.float32:
        err = (out.double() - exact).abs()
        rel = torch.full_like(exact, 4e-7)
        if activation == "gelu_pytorch_tanh":
            rel += 2e-7 * (1.5957691216057308 * (g + 0.044715 * g**3)).abs().clamp(max=80)
        bound = rel * exact.abs() + 1e-30
        assert bool((err <= bound).all()), (err / bound).max().item()
    else:
        within_bf16_rounding(out, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_split_across_threads_give_the_inline_results(ops, dtype):
    """Past kParallelWork elements an op splits its rows across threads: bit for bit what the
    same rows give 64 at a time (small enough to run on the calling thread)."""
    torch.manual_seed(3)
    rows = 700  # 700 x 576 = 403k elements, past the 262k threshold; 64-row pieces are not
    residual, x = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    w = torch.randn(576).to(dtype)
    gu = (torch.randn(rows, 2 * 1536) * 3).to(dtype)
    rot = Rotary({"rope_type": "default", "rope_theta": 10000.0}, 64, 4096)
    qkv = torch.randn(rows, 15, 64).to(dtype)
    positions = torch.randint(0, 4096, (rows,))
    pieces = [slice(i, min(i + 64, rows)) for i in range(0, rows, 64)]

    res_whole, x_whole = residual.clone(), x.clone()
    norm_whole = ops.add_rms_norm_(res_whole, x_whole, w, 1e-5)
    res_rows, x_rows = residual.clone(), x.clone()
    for p in pieces:
        ops.add_rms_norm_(res_rows[p], x_rows[p], w, 1e-5)
    assert torch.equal(res_whole, res_rows) and torch.equal(norm_whole, x_rows)
    assert torch.equal(ops.rms_norm_(x, w, 1e-5, torch.empty_like(x)),
                       torch.cat([ops.rms_norm_(x[p], w, 1e-5, torch.empty_like(x[p]))
                                  for p in pieces]))
    for name, _ in ACTS.values():
        fn = getattr(ops, name)
        assert torch.equal(fn(gu), torch.cat([fn(gu[p]) for p in pieces]))
    whole, by_rows = qkv.clone(), qkv.clone()
    ops.rotary_(whole, 12, positions, rot.cos, rot.sin)
    for p in pieces:
        ops.rotary_(by_rows[p], 12, positions[p], rot.cos, rot.sin)
    assert torch.equal(whole, by_rows)


# -- argmax_rows: greedy sampling's pick -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 49152])
def test_argmax_rows_is_torchs_argmax(ops, dtype, n):
    """Random rows, rows whose maximum repeats (the first wins, in the vector loop and in the
    tail), a NaN (it counts as the maximum: the first NaN), all -inf, -0 against +0, and a
    maximum in the last element (the scalar tail)."""
    torch.manual_seed(n)
    x = torch.randn(9, n).to(dtype)
    x[1] = 0.5
    x[2, n // 2:] = 8.0
    x[3, n // 3] = float("nan")
    x[3, n - 1] = float("nan")
    x[4] = float("-inf")
    x[5] = -1.0
    x[5, n - 1] = -0.0
    x[5, n // 2] = 0.0
    x[6, n - 1] = 100.0
    x[7, n // 2] = float("inf")
    x[8] = float("-inf")
    x[8, n - 1] = float("nan")
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))


def test_argmax_rows_reads_strided_rows_and_splits_across_threads(ops):
    """A view of every other row (row stride twice the width), and 64 rows of a 49,152-token
    vocabulary: past kParallelWork, so split across threads, and still the first maximum."""
    torch.manual_seed(5)
    wide = torch.randn(128, 49152)
    wide[::2, 40000] = 50.0
    wide[::2, 45000] = 50.0
    view = wide[::2]
    assert torch.equal(ops.argmax_rows(view), view.argmax(-1))
    assert bool((ops.argmax_rows(view) == 40000).all())
    with pytest.raises(RuntimeError, match="V > 0"):
        ops.argmax_rows(torch.empty(2, 0))
    with pytest.raises(RuntimeError, match="rows contiguous"):
        ops.argmax_rows(wide.t())


def test_greedy_sampling_runs_the_kernel_and_falls_back_to_torch(monkeypatch):
    """sampler.argmax goes through the C++ pass for CPU float32 and bfloat16 logits, and
    through torch for what the kernel does not take (float16; TOKENLINE_CPU_KERNELS=0, which
    leaves no module): the same tokens either way."""
    from services.scheduler.core import sampler

    torch.manual_seed(2)
    logits = torch.randn(64, 5000)
    calls = []
    real = native_ops.argmax_rows
    monkeypatch.setattr(fused, "_ops_module", type("Spy", (), {
        "argmax_rows": staticmethod(lambda x: calls.append(x.dtype) or real(x))})())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(sampler.argmax(logits.to(dtype)), logits.to(dtype).argmax(-1))
    assert calls == [torch.float32, torch.bfloat16]
    monkeypatch.setattr(fused, "_ops_module", None)
    assert torch.equal(sampler.argmax(logits), logits.argmax(-1))
    assert len(calls) == 2


def test_other_dtypes_are_refused_by_the_kernels_and_run_in_torch():
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native_ops.silu_and_mul(x)
    assert fused.fused_ops(x) is None  # so the layers take the torch path
    assert fused.fused_ops(x.half()) is None
    assert fused.fused_ops(x.float()) is native_ops


# -- whole models: the fused path against the torch path it replaced ---------------------------


def _prefill_then_decode(runner, torch_path: bool, monkeypatch) -> torch.Tensor:
    """Logits of a 12-token prefill's every position, then of one decode step: [13, V]."""
    from services.scheduler.attention.base import AttentionMetadata

    if torch_path:
        monkeypatch.setattr(fused, "_ops_module", None)
    ids = [(37 * i + 11) % 4000 + 10 for i in range(13)]

    def step(begin: int, end: int, idx: torch.Tensor) -> torch.Tensor:
        n = end - begin
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
            slot_mapping=torch.arange(begin, end), query_lens_cpu=[n], seq_lens_cpu=[end],
            page_size=runner.page_size)
        with torch.inference_mode():
            return runner.model(torch.tensor(ids[begin:end]), torch.arange(begin, end), meta,
                                runner.kv_caches, idx)
    out = torch.cat([step(0, 12, torch.arange(12)), step(12, 13, torch.tensor([0]))])
    monkeypatch.undo()
    return out


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3"])
def tiny_family(request, tmp_path_factory, smol_path):
    from bench.families import make_tiny

    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), smol_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_model_logits_near_the_torch_path(tiny_family, dtype, monkeypatch):
    """Llama (SwiGLU), Gemma 3 (GeGLU, q/k norms, norms after each sublayer) and Qwen3 (q/k
    norms) with the fused ops against the same model on the torch ops: float32 logits
    moved by at most 2e-5 (measured: up to 7.2e-6, logits up to ~6.6), the argmax the same at
    every position; bfloat16 (activations and norms in bf16, as --dtype bfloat16 will run
    them; cast here) apart by what bf16 rounds (measured: up to 0.13, 2.5% of the largest
    logit; the fused ops round once per op, the torch ones after every elementwise step)."""
    from services.scheduler.executor.model_runner import ModelRunner

    runner = ModelRunner(tiny_family, device="cpu", dtype="float32", page_size=4,
                         max_total_tokens=64)
    if dtype == "bfloat16":  # what --dtype bfloat16 will run: activations and norms in bf16
        runner.model.to(torch.bfloat16)
        runner.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in runner.kv_caches]
        runner.backend.use_native = False  # the C++ decode kernel is float32-only today
    fused = _prefill_then_decode(runner, False, monkeypatch)
    plain = _prefill_then_decode(runner, True, monkeypatch)
    err = (fused - plain).abs().max().item()
    if dtype == "float32":
        assert err < 2e-5, err
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    else:
        assert err < 0.05 * plain.abs().max().item(), err


def test_fused_decode_step_calls_half_the_torch_ops(tiny_model_dir, monkeypatch):
    """One decode step of a 2-layer Llama: torch ops called from Python (C++ op calls
    included) with the fused ops and without: 128 against 157 (measured), 15 fewer per layer
    (SmolLM2's batch-1 step: 970 against 516, 32 against 17 per layer, `tokenline bench
    profile`)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.step_profile import _count_ops, _Labels, _step_fn
    from services.scheduler.executor.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32",
                         max_total_tokens=512)
    counts = {}
    for torch_path in (False, True):
        if torch_path:
            monkeypatch.setattr(fused, "_ops_module", None)
        fn = _step_fn(runner, "decode1")
        fn()
        with _Labels(runner).regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        counts[torch_path] = sum(_count_ops(prof)[0].values())
    layers_n = runner.num_layers
    assert counts[False] <= counts[True] - 12 * layers_n, counts


def test_quantized_decode_step_calls_no_torch_op_around_its_matmuls(tiny_model_dir):
    """--quantization int4 at batch 1: each projection and the lm_head is one call into the
    C++ kernel, with no reshape or view around it: the one torch op the profile sees per
    matmul is the kernel's own output allocation (there were three: SmolLM2's step ran 363
    torch ops for its 121 matmuls)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.step_profile import _count_ops, _Labels, _step_fn
    from services.scheduler.executor.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32", quantization="int4",
                         max_total_tokens=512)
    fn = _step_fn(runner, "decode1")
    fn()
    with _Labels(runner).regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = _count_ops(prof)[0]
    assert counts["matmuls"] == 4 * runner.num_layers + 1, counts


def lora_factors(k: int, shards: list[int], r: int, dtype: torch.dtype, seed: int):
    """A fused projection's factors as models/lora.py lays them out: A [k, S*r], B [S*r, N]
    block-diagonal (shard s's rows write only its columns), with B's non-zero columns."""
    from services.scheduler.models.lora import nonzero_columns

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(k, len(shards) * r, generator=gen) * 0.1
    b = torch.zeros(len(shards) * r, sum(shards))
    lo = 0
    for s, width in enumerate(shards):
        b[s * r:(s + 1) * r, lo:lo + width] = torch.randn(r, width, generator=gen) * 0.1
        lo += width
    b[-1] = 0  # a zero row (a narrower adapter's padding): [0, 0), skipped
    return a.to(dtype), b.to(dtype), nonzero_columns(b)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [torch.float32, torch.bfloat16])
# one row, a slice, an index, and blocks of 4 rows and a rest
@pytest.mark.parametrize("rows", [[0], [3, 4, 5], [6, 1, 4], [6, 0, 2, 5, 1, 3, 4]])
def test_lora_add_matches_the_low_rank_product(ops, act, factor, rows):
    """out[rows] += (x[rows] @ a) @ b: other rows untouched, the sums in float32, out rounded
    once; the columns outside cols (zero in b) are skipped without changing the result."""
    # 48 columns: 3 blocks of 16, a shard edge inside one; 61: odd rows of the dot products
    a, b, cols = lora_factors(61, [16, 7, 9, 16], 5, factor, seed=len(rows))
    x = torch.randn(7, 61).to(act)
    out = torch.randn(7, 48).to(act)
    exact = out.double().clone()
    idx = torch.tensor(rows)
    exact[idx] += (x.double()[idx] @ a.double()) @ b.double()
    index = idx if rows != [3, 4, 5] else torch.empty(0, dtype=torch.long)
    got = ops.lora_add_(out, x, a.T.contiguous(), b, cols, index, rows[0], len(rows))
    assert got is out
    if act == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        within_bf16_rounding(out, exact)


def test_lora_add_refuses_bad_arguments(ops):
    a, b, cols = lora_factors(8, [4, 4], 2, torch.float32, seed=0)
    x, out, none = torch.randn(3, 8), torch.zeros(3, 8), torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="cols row"):
        ops.lora_add_(out, x, a.T.contiguous(), b, torch.full_like(cols, 9), none, 0, 1)
    with pytest.raises(RuntimeError, match="row 3 outside"):
        ops.lora_add_(out, x, a.T.contiguous(), b, cols, none, 2, 2)
    with pytest.raises(RuntimeError, match=r"at \[R, K\]"):
        ops.lora_add_(out, x, a, b, cols, none, 0, 1)
