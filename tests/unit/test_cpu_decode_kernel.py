"""The C++ CPU decode kernel gives what the plain-torch path gives, read from the same cache."""

from __future__ import annotations

import platform

import pytest
import torch

from services.scheduler.attention import torch_backend
from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.attention.torch_backend import TorchBackend, native_kernels
from services.scheduler.native import DECODE, cpu_flags
from tests.helpers import portable_build


@pytest.fixture(scope="module")
def kernels():
    """The built kernel; a skip only where the machine cannot build it at all, naming why."""
    native = native_kernels()
    if native.missing:
        pytest.skip(f"{native.missing}: the torch path is all there is")
    assert native.module is not None, f"the CPU decode kernel should build here: {native.error}"
    return native.module


def random_step(spans: list[tuple[int, int]], page: int, hq: int, hkv: int, d: int, seed: int):
    """Request b has spans[b] = (cached tokens, new tokens), its blocks anywhere in a shuffled
    pool, -1 past the end of its table, and random values in every slot of the cache."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // page) for c, n in spans]
    pool = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = torch.full((len(spans), max(need) + 2), -1, dtype=torch.int32)
    for b in range(len(spans)):
        tables[b, : need[b]] = torch.tensor([pool.pop() for _ in range(need[b])])
    meta = AttentionMetadata.for_spans(spans, tables, page)
    tokens = sum(meta.query_lens_cpu)
    slots_total = (sum(need) + 3) * page

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return (rand(tokens, hq, d), rand(tokens, hkv, d), rand(tokens, hkv, d),
            rand(slots_total, hkv, d), rand(slots_total, hkv, d), meta)


# query heads per KV head 3, 1, 8, 3, 6 and 2: every row count the AVX2 scores take at a time
# (8 rows for 1 head, 4 for 2-3, 2 for 4-7, 1 for 8)
@pytest.mark.parametrize("page,hq,hkv,d", [(16, 9, 3, 64), (16, 8, 8, 64), (32, 8, 1, 128),
                                           (4, 6, 2, 80), (16, 6, 1, 64), (8, 4, 2, 32)])
@pytest.mark.parametrize("mixed", [False, True])
def test_native_decode_matches_the_torch_path(kernels, page, hq, hkv, d, mixed):
    gen = torch.Generator().manual_seed(page * hq + d)
    cached = torch.randint(0, 700, (12,), generator=gen).tolist()
    spans = [(c, 5 if mixed and i % 4 == 0 else 1) for i, c in enumerate(cached)]
    q, k, v, k_cache, v_cache, meta = random_step(spans, page, hq, hkv, d, seed=d)
    scale = d**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, scale)
    got = TorchBackend(use_native=True).forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def as_projection_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k and v as the model hands them over: strided views of one [T, Hq + 2 Hkv, D] qkv
    projection output, not contiguous tensors of their own."""
    heads = torch.cat([q, k, v], dim=1)
    return heads.split([q.shape[1], k.shape[1], v.shape[1]], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,window", [("decode", None), ("mixed", None), ("decode", 37),
                                         ("mixed", 37), ("one long", None), ("one long", 300)])
def test_one_call_per_layer_writes_the_cache_and_attends_from_projection_rows(
        kernels, dtype, kind, window):
    """The decode-only step's single kernel call (cache writes inside) and the mixed step's
    (its decode rows read from and written to the step's own rows) leave the cache and give
    the output of the torch path, from q, k, v as strided views; odd lengths, a sliding
    window, and one long request cut into pieces across the cores and merged."""
    spans = {
        "decode": [(c, 1) for c in (0, 1, 15, 16, 17, 63, 64, 65, 333, 700, 1)],
        "mixed": [(0, 9), (5, 1), (16, 1), (40, 3), (127, 1), (0, 1), (250, 1)],
        "one long": [(1999, 1)],
    }[kind]
    *tensors, meta = random_step(spans, 16, 9, 3, 64, seed=len(spans))
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in tensors)
    q, k, v = as_projection_rows(q, k, v)
    assert q.stride(0) == k.stride(0) == (9 + 2 * 3) * 64  # rows of the projection
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, 0.125, window)
    got = TorchBackend(use_native=True).forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:  # torch's bf16 SDPA rounds its probabilities to bf16; the kernel keeps them float32
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_write_kv_is_index_copy_and_refuses_slots_outside_the_cache(kernels):
    *_, k_cache, v_cache, _ = random_step([(3, 1)], 16, 4, 2, 32, seed=5)
    q, k, v = as_projection_rows(torch.randn(6, 4, 32), torch.randn(6, 2, 32),
                                 torch.randn(6, 2, 32))
    slots = torch.tensor([7, 0, 31, 8, 9, 30])
    want_k, want_v = k_cache.clone().index_copy_(0, slots, k), v_cache.clone().index_copy_(
        0, slots, v)
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    past = k_cache.shape[0]
    with pytest.raises(RuntimeError, match=f"slot {past} out of range"):
        kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, past]))
    with pytest.raises(RuntimeError, match="slot -1 out of range"):
        kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, -1]))


def bf16_step(page: int, hq: int, hkv: int, d: int, mixed: bool):
    """A random step (see random_step) with q, k, v and both caches rounded to bfloat16."""
    gen = torch.Generator().manual_seed(page * hq + d + 1)
    cached = torch.randint(0, 700, (12,), generator=gen).tolist()
    spans = [(c, 5 if mixed and i % 4 == 0 else 1) for i, c in enumerate(cached)]
    *tensors, meta = random_step(spans, page, hq, hkv, d, seed=d + 1)
    return *(t.bfloat16() for t in tensors), meta


def check_bf16_decode(decode, page, hq, hkv, d, mixed, window):
    """`decode` (a backend) on bfloat16 inputs against the float32 kernel on the same values:
    within bf16's rounding of the output (half an ulp: 2^-9 of the value), and against torch's
    own bfloat16 SDPA path (the reference), which rounds its probabilities to bf16 as well."""
    q, k, v, k_cache, v_cache, meta = bf16_step(page, hq, hkv, d, mixed)
    scale = d**-0.5
    exact = TorchBackend(use_native=True).forward(
        q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, scale, window)
    got = decode.forward(q, k, v, k_cache, v_cache, meta, scale, window)
    assert got.dtype == torch.bfloat16
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # bf16 writes, same
    starts = meta.query_start_loc.tolist()
    decodes = [starts[b] for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    torch.testing.assert_close(got[decodes].float(), exact[decodes], atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # and closer to the exact answer than a bf16 rounding of torch's, or about as close
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() + 2**-8


@pytest.mark.parametrize("page,hq,hkv,d", [(16, 9, 3, 64), (16, 8, 8, 64), (32, 8, 1, 128),
                                           (4, 6, 2, 80), (16, 8, 2, 256), (8, 4, 4, 96),
                                           (16, 4, 2, 32)])
@pytest.mark.parametrize("mixed,window", [(False, None), (True, None), (False, 37)])
def test_bf16_decode_matches_float32_and_the_torch_path(kernels, page, hq, hkv, d, mixed,
                                                        window):
    check_bf16_decode(TorchBackend(use_native=True), page, hq, hkv, d, mixed, window)


def test_bf16_kernel_uses_avx512_bf16_where_the_cpu_has_it(kernels):
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to check against")
    assert kernels.fast_bf16() == {"avx512_bf16", "avx512bw", "avx512vl"}.issubset(flags)


def test_kernel_names_the_vector_path_this_cpu_builds(kernels):
    """What the start-up log's decode_attention_isa says: the path -march=native picked."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to check against")
    want = ("avx512_bf16" if {"avx512_bf16", "avx512bw", "avx512vl"}.issubset(flags)
            else "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"}.issubset(flags)
            else "portable")
    assert kernels.isa() == want


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-mno-avx512f (the AVX2 build) is an x86 compiler flag")
def test_portable_bf16_kernel_matches_too(kernels, monkeypatch):
    """The path an AVX2-only CPU builds: the same source without AVX-512 (its own build)."""
    module = portable_build(DECODE.source, "the portable decode kernel").module
    assert module is not None and not module.fast_bf16()
    monkeypatch.setattr(torch_backend, "cpu_kernels", lambda: module)
    for d in (64, 80):
        check_bf16_decode(TorchBackend(use_native=True), 16, 6, 2, d, mixed=True, window=None)
        check_bf16_decode(TorchBackend(use_native=True), 16, 6, 2, d, mixed=False, window=37)
    # and float32, from the projection's strided rows, one long request merged from pieces
    for spans, window in ([(c, 1) for c in (0, 17, 300, 64)], None), ([(900, 1)], 100), (
            [(0, 7), (40, 1), (3, 1)], None):
        *tensors, meta = random_step(spans, 16, 9, 3, 64, seed=len(spans))
        q, k, v = as_projection_rows(*tensors[:3])
        ref_k, ref_v = tensors[3].clone(), tensors[4].clone()
        want = TorchBackend().forward(q, k, v, ref_k, ref_v, meta, 0.125, window)
        got = TorchBackend(use_native=True).forward(q, k, v, *tensors[3:], meta, 0.125, window)
        assert torch.equal(tensors[3], ref_k) and torch.equal(tensors[4], ref_v)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_kernel_says_which_shapes_it_has(kernels):
    assert kernels.supports(64, 3) and kernels.supports(128, 8)
    assert not kernels.supports(72, 3) and not kernels.supports(64, 9)


def test_model_runner_decodes_through_the_kernel(kernels, smol_path):
    from services.scheduler.executor.model_runner import ModelRunner

    runner = ModelRunner(smol_path, max_total_tokens=256, device="cpu", dtype="float32")
    assert runner.attention_kernel == "native" and runner.backend.use_native


def test_a_kernel_that_fails_to_build_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """With a compiler at hand, a build error raises under TOKENLINE_CPU_KERNELS=require (what
    the suite runs with) and is recorded, not lost, when users fall back to torch."""
    if native_kernels().missing:
        pytest.skip(f"{native_kernels().missing}: nothing is built here")
    broken = tmp_path / "paged_decode_cpu.cpp"
    broken.write_text("#error a compile error, on purpose\n")
    monkeypatch.setattr(DECODE, "source", broken)
    monkeypatch.setattr(DECODE, "_state", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("TOKENLINE_CPU_KERNELS", "1")
    assert torch_backend.cpu_kernels() is None  # users: plain torch, and the reason is kept
    native = native_kernels()
    assert native.module is None and native.missing is None
    assert "compile error, on purpose" in native.error
    monkeypatch.setenv("TOKENLINE_CPU_KERNELS", "require")
    with pytest.raises(RuntimeError, match="(?s)did not build.*compile error, on purpose"):
        native_kernels()
