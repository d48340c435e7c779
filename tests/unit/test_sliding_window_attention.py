"""Sliding-window attention on every backend (torch, the C++ decode and prefill kernels, Triton
under the interpreter) equals a plain per-token reference: each query sees its last W positions
only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.scheduler.attention.torch_backend import TorchBackend, native_kernels, prefill_kernels
from services.scheduler.attention.triton_backend import TritonBackend
from tests.unit.test_triton_attention import DEVICES, TOLERANCE, make_step


def reference(step, scale: float, window: int) -> torch.Tensor:
    """Token by token: softmax over the cached rows at positions (p - window, p]."""
    meta = step.meta
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = step.k, step.v
    group = step.q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(step.q)
    t = 0
    for b, (n, total) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        for p in range(total - n, total):
            seen = torch.arange(max(0, p - window + 1), p + 1)
            blocks = meta.block_tables[b, seen // meta.page_size].long()
            slots = blocks * meta.page_size + seen % meta.page_size
            keys = k_cache[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
            values = v_cache[slots].repeat_interleave(group, dim=1)
            weights = torch.einsum("hd,lhd->hl", step.q[t], keys).mul(scale).softmax(-1)
            out[t] = torch.einsum("hl,lhd->hd", weights, values)
            t += 1
    return out


BACKENDS = {
    "torch": lambda: TorchBackend(),
    "native": lambda: TorchBackend(use_native=True, use_native_prefill=True),
    "triton": lambda: TritonBackend(min_split_tokens=16, decode_block_n=16, extend_block_m=16,
                                    extend_block_n=16),
}
# fresh prompts longer than the window, extends across it, decodes far past it and inside it
SPANS = {
    "decode": [(40, 1), (3, 1), (100, 1), (16, 1)],
    "mixed": [(0, 45), (33, 20), (90, 1), (5, 1), (0, 7), (60, 30)],
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", list(SPANS))
@pytest.mark.parametrize("window", [1, 17, 64])
def test_sliding_window_matches_reference(backend, kind, window):
    missing = native_kernels().missing or prefill_kernels().missing  # a failed build raises
    if backend == "native" and missing:
        pytest.skip(f"{missing}: no C++ kernel to test")
    step = make_step(SPANS[kind], page_size=8, q_heads=4, kv_heads=2, head_dim=32,
                     device="cpu", seed=window)
    scale = 32**-0.5
    want = reference(step, scale, window)
    # Triton runs where it runs (compiled on CUDA, else the interpreter); the rest on CPU
    device = DEVICES[0] if backend == "triton" else "cpu"
    run = dataclasses.replace(
        step, **{f: getattr(step, f).to(device) for f in ("q", "k", "v", "k_cache", "v_cache")},
        meta=dataclasses.replace(step.meta, **{
            f: getattr(step.meta, f).to(device)
            for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")}))
    got = BACKENDS[backend]().forward(run.q, run.k, run.v, run.k_cache, run.v_cache,
                                      run.meta, scale, window=window)
    # compiled on a GPU, the Triton tests' own float32 tolerance
    tol = TOLERANCE[torch.float32] if device != "cpu" else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), want, **tol)


def test_full_attention_is_a_window_as_long_as_the_context():
    step = make_step(SPANS["mixed"], page_size=8, q_heads=4, kv_heads=2, head_dim=32,
                     device="cpu", seed=3)
    scale = 32**-0.5
    want = reference(step, scale, window=10_000)
    got = TorchBackend().forward(step.q, step.k, step.v, step.k_cache, step.v_cache,
                                 step.meta, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
