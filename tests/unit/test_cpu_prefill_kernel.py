"""The C++ CPU prefill/extend kernel against attention computed in float64 from the same cache.

Each step mixes fresh prompts, extends after cached prefixes that end mid-page, chunks of one
token and more, and decodes; every length is odd somewhere. Tolerances: float32 agrees with the
float64 answer to 1e-5 (sums in another order); bfloat16 (q and the cache rounded to bf16, the
reference computed from those rounded values) to 2^-8 of the value plus 5e-3: the output's own
rounding to bf16 (2^-9 of it) and that of the probabilities before P @ V (2^-9 of each, times
values of up to ~4 here), which torch's bf16 flash kernel rounds as well; and it is no further
from the exact answer than torch's bf16 SDPA is.
"""

from __future__ import annotations

import platform
from dataclasses import replace

import pytest
import torch

from services.scheduler.attention import torch_backend
from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.attention.torch_backend import SdpaRoute, TorchBackend, prefill_kernels
from services.scheduler.native import PREFILL, cpu_flags
from tests.helpers import portable_build
from tests.unit.test_cpu_decode_kernel import random_step

# (cached tokens, new tokens) per request: fresh prompts (odd lengths, one longer than a tile
# of keys and of queries), extends after prefixes that end mid-page, a 2-token chunk, decodes
SPANS = [(0, 37), (13, 90), (0, 1), (50, 5), (0, 181), (33, 16), (100, 2), (7, 1), (0, 3)]
SHAPES = [(16, 9, 3, 64), (16, 8, 8, 64), (32, 8, 1, 128), (4, 6, 2, 80), (16, 8, 2, 256),
          (8, 4, 4, 96), (16, 4, 2, 32), (16, 14, 2, 64)]


@pytest.fixture(scope="module")
def kernels():
    """The built kernel; a skip only where the machine cannot build it at all, naming why."""
    native = prefill_kernels()
    if native.missing:
        pytest.skip(f"{native.missing}: the torch path is all there is")
    assert native.module is not None, f"the CPU prefill kernel should build here: {native.error}"
    return native.module


def reference(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              window: int | None) -> torch.Tensor:
    """Attention of every new token in float64, from the cache (the step's k, v written)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts, p = meta.query_start_loc.tolist(), meta.page_size
    group = q.shape[1] // k_cache.shape[1]
    for b, n in enumerate(meta.query_lens_cpu):
        total = meta.seq_lens_cpu[b]
        slots = [int(meta.block_tables[b, i // p]) * p + i % p for i in range(total)]
        keys = k_cache[slots].double().repeat_interleave(group, 1)  # [total, Hq, D]
        values = v_cache[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[starts[b] : starts[b + 1]].double(), keys)
        qpos = torch.arange(total - n, total)[:, None]
        kpos = torch.arange(total)[None, :]
        seen = (kpos <= qpos) & (kpos > qpos - window if window else True)
        probs = (scores * scale).masked_fill(~seen, float("-inf")).softmax(-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("htl,lhd->thd", probs, values)
    return out


def step(page: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    q, k, v, k_cache, v_cache, meta = random_step(SPANS, page, hq, hkv, d, seed=hq * d)
    return (*(t.to(dtype) for t in (q, k, v, k_cache, v_cache)), meta)


def native_backend() -> TorchBackend:
    return TorchBackend(use_native=True, use_native_prefill=True)


@pytest.mark.parametrize("page,hq,hkv,d", SHAPES)
@pytest.mark.parametrize("window", [None, 37])
def test_float32_prefill_and_extend_match_float64(kernels, page, hq, hkv, d, window):
    q, k, v, k_cache, v_cache, meta = step(page, hq, hkv, d, torch.float32)
    got = native_backend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5, window)
    want = reference(q, k_cache, v_cache, meta, d**-0.5, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def check_bf16(backend: TorchBackend, page, hq, hkv, d, window) -> None:
    q, k, v, k_cache, v_cache, meta = step(page, hq, hkv, d, torch.bfloat16)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_says = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, d**-0.5, window)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5, window)
    assert got.dtype == torch.bfloat16
    exact = reference(q, k_cache, v_cache, meta, d**-0.5, window)
    torch.testing.assert_close(got.double(), exact, atol=5e-3, rtol=2**-8)
    assert (got.double() - exact).abs().max() <= (torch_says.double() - exact).abs().max() + 2**-8


@pytest.mark.parametrize("page,hq,hkv,d", SHAPES)
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_prefill_and_extend_match_float64(kernels, page, hq, hkv, d, window):
    check_bf16(native_backend(), page, hq, hkv, d, window)


@pytest.mark.parametrize("window", [None, 37])
def test_long_fresh_prompts_through_sdpa_beside_the_kernel(kernels, window):
    """An SdpaRoute's prompts_from (bfloat16 on AMX CPUs): fresh prompts of at least that many
    tokens run SDPA, the shorter ones, the extends and the decodes the kernels, in the same
    step."""
    backend = native_backend()
    backend.sdpa = SdpaRoute(prompts_from=37)
    q, k, v, k_cache, v_cache, meta = step(16, 9, 3, 64, torch.float32)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert backend._plan.sdpa_rows == [0, 4]  # (0, 37) and (0, 181); not (13, 90) nor (0, 3)
    assert backend._plan.prefill_rows.tolist() == [1, 3, 5, 6, 8]
    want = reference(q, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    backend = native_backend()
    backend.sdpa = SdpaRoute(prompts_from=37)
    check_bf16(backend, 16, 9, 3, 64, window)


@pytest.mark.parametrize("window", [None, 37])
def test_long_extends_through_sdpa_beside_the_kernel(kernels, window):
    """An SdpaRoute's extend_pairs (bfloat16 on AMX CPUs): an extend of at least extend_min_new
    new tokens and that many attended (query, key) pairs runs SDPA over its gathered prefix;
    the smaller extends stay in the kernel, in the same step. AMX_BF16's own thresholds, scaled
    down to this step's sizes."""
    assert 16 < torch_backend.AMX_BF16.extend_min_new <= 90
    route = replace(torch_backend.AMX_BF16, prompts_from=37,
                    extend_pairs=90 * 13 + 90 * 91 // 2)  # (13, 90)'s
    backend = native_backend()
    backend.sdpa = route
    q, k, v, k_cache, v_cache, meta = step(16, 9, 3, 64, torch.float32)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    # (13, 90) and the long fresh prompts; not (50, 5) nor (33, 16): too few new tokens
    assert backend._plan.sdpa_rows == [0, 1, 4]
    assert backend._plan.prefill_rows.tolist() == [3, 5, 6, 8]
    want = reference(q, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    backend = native_backend()  # (a backend plans once per step's metadata)
    backend.sdpa = replace(route, extend_pairs=route.extend_pairs + 1)  # one short
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert backend._plan.sdpa_rows == [0, 4]
    backend = native_backend()
    backend.sdpa = replace(route, extend_pairs=None)  # extends stay in the kernel
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert backend._plan.sdpa_rows == [0, 4]
    backend = native_backend()
    backend.sdpa = replace(route, extend_pairs=1, extend_min_new=91)  # (13, 90): too few new
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert backend._plan.sdpa_rows == [0, 4]
    backend = native_backend()  # no route: nothing goes to SDPA
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert backend._plan.sdpa_rows == []
    backend = native_backend()
    backend.sdpa = replace(route, extend_pairs=5000)
    check_bf16(backend, 16, 9, 3, 64, window)


@pytest.mark.parametrize("window", [None, 20])
def test_bf16_prompts_padded_for_sdpa_match_the_unpadded_answer(window):
    """Fresh bfloat16 prompts go to SDPA padded with zero rows to a multiple of SDPA_PAD (the
    flash kernel is slow at other lengths): the real rows are what the float64 answer says, as
    close as the unpadded call is, and q, k, v are read as the projection's strided rows."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 9, 3, 64
    for n in (2, 15, 17, 33, 100, 181):
        qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).bfloat16()
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        o = torch_backend._fresh_prompt(q, k, v, d**-0.5, window)
        assert o.shape[2] == -(-n // torch_backend.SDPA_PAD) * torch_backend.SDPA_PAD
        got = o[0, :, :n].transpose(0, 1).double()
        pos = torch.arange(n)
        gap = pos[:, None] - pos[None, :]
        seen = (gap >= 0) & (gap < window if window else True)
        group = hq // hkv
        scores = torch.einsum("thd,lhd->htl", q.double(),
                              k.double().repeat_interleave(group, 1)) * d**-0.5
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        exact = torch.einsum("htl,lhd->thd", probs, v.double().repeat_interleave(group, 1))
        unpadded = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=seen, scale=d**-0.5, enable_gqa=True)[0].transpose(0, 1).double()
        torch.testing.assert_close(got, exact, atol=5e-3, rtol=2**-8)
        assert (got - exact).abs().max() <= (unpadded - exact).abs().max() + 2**-8


def test_only_the_new_tokens_rows_are_written(kernels):
    """The kernel fills the rows of the requests it is given and leaves the others as they are
    (TorchBackend puts the decode rows there)."""
    q, _, _, k_cache, v_cache, meta = step(16, 9, 3, 64, torch.float32)
    out = torch.full_like(q, 7.0)
    rows = torch.tensor([1, 4])
    kernels.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, rows, 16, 0.125, 0, out)
    starts = meta.query_start_loc.tolist()
    mine = torch.zeros(q.shape[0], dtype=torch.bool)
    for b in rows.tolist():
        mine[starts[b] : starts[b + 1]] = True
    assert torch.all(out[~mine] == 7.0)
    want = reference(q, k_cache, v_cache, meta, 0.125, None)
    torch.testing.assert_close(out[mine].double(), want[mine], atol=1e-5, rtol=1e-5)


def test_bf16_kernel_uses_avx512_bf16_where_the_cpu_has_it(kernels):
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to check against")
    assert kernels.fast_bf16() == {"avx512_bf16", "avx512bw", "avx512vl"}.issubset(flags)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-mno-avx512f (the AVX2 build) is an x86 compiler flag")
def test_portable_kernel_matches_too(kernels, monkeypatch):
    """The path an AVX2-only CPU builds (8 lanes, bf16 widened to float32): the same source
    without AVX-512, its own build."""
    state = portable_build(PREFILL.source, "the portable prefill kernel")
    assert state.module is not None and not state.module.fast_bf16()
    monkeypatch.setattr(torch_backend, "prefill_kernels", lambda: state)
    for page, hq, hkv, d in [(16, 9, 3, 64), (4, 6, 2, 80)]:
        for window in (None, 37):
            q, k, v, k_cache, v_cache, meta = step(page, hq, hkv, d, torch.float32)
            got = native_backend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5, window)
            want = reference(q, k_cache, v_cache, meta, d**-0.5, window)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
            check_bf16(native_backend(), page, hq, hkv, d, window)


def test_kernel_says_which_shapes_it_has(kernels):
    assert kernels.supports(64, 3) and kernels.supports(128, 8) and kernels.supports(256, 4)
    assert not kernels.supports(72, 3) and not kernels.supports(64, 9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_runner_prefills_through_the_kernel(kernels, smol_path, dtype, monkeypatch):
    from services.scheduler.executor.model_runner import ModelRunner

    # long fresh bfloat16 prompts go to SDPA where the CPU has AMX, never in float32
    sdpa = dtype == "bfloat16" and "amx_bf16" in cpu_flags()
    want = f"native+sdpa_from_{torch_backend.AMX_BF16.prompts_from}" if sdpa else "native"
    runner = ModelRunner(smol_path, max_total_tokens=256, device="cpu", dtype=dtype)
    assert runner.prefill_kernel == want and runner.backend.use_native_prefill
    assert runner.info()["prefill_attention"] == want
    assert runner.backend.sdpa == (torch_backend.AMX_BF16 if sdpa else None)
    monkeypatch.setenv("TOKENLINE_SDPA_PROMPTS_FROM", "300")  # moves the prompts' crossover
    runner = ModelRunner(smol_path, max_total_tokens=256, device="cpu", dtype=dtype)
    assert runner.prefill_kernel == "native+sdpa_from_300"
    assert runner.backend.sdpa == replace(torch_backend.AMX_BF16, prompts_from=300)
    monkeypatch.setenv("TOKENLINE_SDPA_PROMPTS_FROM", "off")
    runner = ModelRunner(smol_path, max_total_tokens=256, device="cpu", dtype=dtype)
    assert runner.prefill_kernel == "native" and runner.backend.sdpa is None
    monkeypatch.setenv("TOKENLINE_SDPA_PROMPTS_FROM", "1")
    with pytest.raises(ValueError, match="off or an integer >= 2"):
        ModelRunner(smol_path, max_total_tokens=256, device="cpu", dtype=dtype)


# Long contexts, SmolLM2's heads (9 query over 3 KV heads of 64, page 16): extends after
# prefixes of 4,001 and 4,097 tokens (ending mid-page), decodes at 4,100 and 4,133 (the decode
# kernel's pieces of one request split over the cores and merged) and a short one beside them
LONG_SPANS = [(4001, 99), (4099, 1), (4097, 3), (0, 1), (4132, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_extend_at_4k_context_match_float64(kernels, dtype):
    """Both kernels over more than 4k cached tokens, against float64 from the same (rounded)
    values: float32 to 1e-5, bfloat16 as check_bf16 allows (the output's and probabilities'
    bf16 rounding), and no further from the exact answer than torch's own path."""
    *tensors, meta = random_step(LONG_SPANS, 16, 9, 3, 64, seed=4100)
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in tensors)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    backend = native_backend()
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, None)
    assert backend._plan.decode_rows == [1, 3, 4]  # the decode kernel's; the rest the prefill's
    exact = reference(q, k_cache, v_cache, meta, 0.125, None)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        return
    torch_says = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, 0.125, None)
    torch.testing.assert_close(got.double(), exact, atol=5e-3, rtol=2**-8)
    assert (got.double() - exact).abs().max() <= (torch_says.double() - exact).abs().max() + 2**-8
