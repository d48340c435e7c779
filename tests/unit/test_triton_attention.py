"""The Triton paged-attention backend agrees with the torch reference backend.

Without a GPU the kernels run in Triton's interpreter on CPU tensors. TRITON_INTERPRET is
read when the kernels are decorated, so it is set before the backend module is imported.
With a GPU (and TRITON_INTERPRET unset) the same tests run compiled on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from services.scheduler.attention.base import AttentionMetadata  # noqa: E402
from services.scheduler.attention.torch_backend import TorchBackend  # noqa: E402
from services.scheduler.attention.triton_backend import TritonBackend  # noqa: E402
from services.scheduler.attention.triton_kernels import store_kvcache  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else ["cuda"]
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_step(
    spans: list[tuple[int, int]],
    *,
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Step:
    """One step where request b has spans[b] = (cached tokens, new tokens).

    Blocks come from a shuffled pool with spare blocks, so tables are non-contiguous; the
    whole pool is random, so a kernel reading a wrong slot shows up as a mismatch. Table
    entries past a request's end are -1, which kernels must never dereference.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(cached + new) // page_size) for cached, new in spans]
    num_blocks = sum(need) + 4
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(spans), max(need) + 1), -1, dtype=torch.int32)
    slots: list[int] = []
    for b, (cached, new) in enumerate(spans):
        tables[b, : need[b]] = torch.tensor([pool.pop() for _ in range(need[b])])
        for pos in range(cached, cached + new):
            slots.append(int(tables[b, pos // page_size]) * page_size + pos % page_size)
    query_lens = [new for _, new in spans]
    seq_lens = [cached + new for cached, new in spans]
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    num_tokens = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        page_size=page_size,
    )
    return Step(
        q=rand(num_tokens, q_heads, head_dim),
        k=rand(num_tokens, kv_heads, head_dim),
        v=rand(num_tokens, kv_heads, head_dim),
        k_cache=rand(num_blocks * page_size, kv_heads, head_dim),
        v_cache=rand(num_blocks * page_size, kv_heads, head_dim),
        meta=meta,
    )


def assert_matches_reference(step: Step, backend: TritonBackend | None = None) -> None:
    """Output and the cache after the step both equal what TorchBackend produces."""
    backend = backend or TritonBackend()
    scale = step.q.shape[-1] ** -0.5
    ref_k, ref_v = step.k_cache.clone(), step.v_cache.clone()
    expected = TorchBackend().forward(step.q, step.k, step.v, ref_k, ref_v, step.meta, scale)
    got = backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, scale)
    assert torch.equal(step.k_cache, ref_k) and torch.equal(step.v_cache, ref_v)
    torch.testing.assert_close(got, expected, **TOLERANCE[step.q.dtype])


def random_spans(seed: int, count: int, max_cached: int, max_new: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    cached = torch.randint(0, max_cached + 1, (count,), generator=gen).tolist()
    new = torch.randint(1, max_new + 1, (count,), generator=gen).tolist()
    return list(zip(cached, new, strict=True))


# (page size, query heads, KV heads, head dim): each GQA ratio and head dim appears at least
# once with each page size, without the full product (the interpreter is slow).
SHAPES = [
    (16, 2, 2, 64),
    (32, 3, 1, 128),
    (16, 6, 2, 128),
    (32, 8, 1, 64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,q_heads,kv_heads,head_dim", SHAPES)
def test_decode_with_split_k_matches_reference(
    device: str, page_size: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    spans = [(c, 1) for c, _ in random_spans(page_size + q_heads, 5, 300, 1)]
    spans[0] = (0, 1)  # a request whose only KV is its own new token
    step = make_step(spans, page_size=page_size, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, device=device, seed=page_size + head_dim)
    backend = TritonBackend(min_split_tokens=32)
    # Requests shorter than the longest leave trailing splits empty; those must weigh 0.
    assert backend.plan_splits(5, kv_heads, step.meta.max_seq_len, torch.device(device))[0] > 1
    assert_matches_reference(step, backend)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_single_split_matches_reference(device: str) -> None:
    spans = [(30, 1), (7, 1), (90, 1)]
    step = make_step(spans, page_size=16, q_heads=4, kv_heads=2, head_dim=64, device=device)
    assert_matches_reference(step, TritonBackend(min_split_tokens=4096))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,q_heads,kv_heads,head_dim", SHAPES)
def test_prefill_and_prefix_hit_match_reference(
    device: str, page_size: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    # Fresh prompts (nothing cached) next to prefix-cache hits (cached prefix, new tail),
    # with lengths that do not line up with pages or tiles.
    spans = [(0, 45), (0, 1 + page_size), (33, 20), (page_size * 2, 70)]
    step = make_step(spans, page_size=page_size, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, device=device, seed=head_dim + q_heads)
    assert_matches_reference(step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,q_heads,kv_heads,head_dim", SHAPES[:2])
def test_mixed_decode_and_extend_batch_matches_reference(
    device: str, page_size: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    spans = random_spans(7, 6, 150, 40)
    spans[1] = (120, 1)
    spans[4] = (0, 1)
    step = make_step(spans, page_size=page_size, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, device=device, seed=3)
    assert_matches_reference(step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,q_heads,kv_heads,head_dim", SHAPES)
def test_random_batches_with_small_tiles_match_reference(
    device: str, page_size: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    # Tiles of 16 are smaller than a page, and many splits and query tiles per request:
    # the index arithmetic the default tile sizes hide.
    backend = TritonBackend(min_split_tokens=16, decode_block_n=16, extend_block_m=16,
                            extend_block_n=16)
    for seed in range(2):
        decode = [(c, 1) for c, _ in random_spans(seed, 4, 120, 1)]
        mixed = random_spans(seed + 100, 4, 80, 40)
        for spans in (decode, mixed):
            step = make_step(spans, page_size=page_size, q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, device=device, seed=seed)
            assert_matches_reference(step, backend)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_then_decode_equals_whole_prompt(device: str) -> None:
    """A prompt fed in chunks, then decoded, gives what attention over the whole prompt gives."""
    page_size, q_heads, kv_heads, head_dim = 16, 6, 2, 64
    prompt, chunks = 100, [37, 40, 23]
    whole = make_step([(0, prompt + 2)], page_size=page_size, q_heads=q_heads,
                      kv_heads=kv_heads, head_dim=head_dim, device=device, seed=11)
    scale = head_dim**-0.5
    expected = TorchBackend().forward(whole.q, whole.k, whole.v, whole.k_cache.clone(),
                                      whole.v_cache.clone(), whole.meta, scale)
    backend = TritonBackend(min_split_tokens=32)
    table = whole.meta.block_tables
    pieces = []
    start = 0
    for n in [*chunks, 1, 1]:
        end = start + n
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=table,
            slot_mapping=whole.meta.slot_mapping[start:end],
            query_lens_cpu=[n],
            seq_lens_cpu=[end],
            page_size=page_size,
        )
        pieces.append(backend.forward(whole.q[start:end], whole.k[start:end],
                                      whole.v[start:end], whole.k_cache, whole.v_cache,
                                      meta, scale))
        start = end
    torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(device: str, dtype: torch.dtype) -> None:
    spans = [(50, 1), (0, 30), (70, 9)]
    step = make_step(spans, page_size=16, q_heads=4, kv_heads=1, head_dim=64, device=device,
                     dtype=dtype, seed=5)
    assert_matches_reference(step)
    decode = make_step([(80, 1), (5, 1)], page_size=32, q_heads=4, kv_heads=1, head_dim=64,
                       device=device, dtype=dtype, seed=6)
    assert_matches_reference(decode, TritonBackend(min_split_tokens=32))


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_not_power_of_two_is_masked(device: str) -> None:
    for spans, seed in (([(40, 1), (100, 1)], 8), ([(20, 13), (0, 9)], 9)):
        step = make_step(spans, page_size=16, q_heads=2, kv_heads=1, head_dim=80,
                         device=device, seed=seed)
        assert_matches_reference(step, TritonBackend(min_split_tokens=32))


@pytest.mark.parametrize("device", DEVICES)
def test_store_kvcache_writes_only_mapped_slots(device: str) -> None:
    k = torch.randn(4, 3, 64, device=device)
    v = torch.randn(4, 3, 64, device=device)
    # Strided views, as a fused QKV projection would hand over.
    k, v = k[:, :2], v[:, :2]
    k_cache = torch.zeros(32, 2, 64, device=device)
    v_cache = torch.zeros(32, 2, 64, device=device)
    slots = torch.tensor([9, -1, 0, 31], dtype=torch.int64, device=device)
    store_kvcache(k, v, k_cache, v_cache, slots)
    keep = torch.tensor([0, 2, 3], device=device)
    assert torch.equal(k_cache[slots[keep]], k[keep])
    assert torch.equal(v_cache[slots[keep]], v[keep])
    untouched = torch.ones(32, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
