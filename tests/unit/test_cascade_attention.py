"""Decode rows that share a long cached prefix attend it once, stacked (cascade.py): the same
numbers as the C++ kernel's row by row and as the plain-torch path's, in both dtypes."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.attention import cascade
from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.attention.torch_backend import TorchBackend, native_kernels

EVERY_GROUP = {torch.float32: 0, torch.bfloat16: 0}  # MIN_PAIRS that passes rows and tokens


@pytest.fixture(scope="module", autouse=True)
def kernels():
    native = native_kernels()
    if native.missing:
        pytest.skip(f"{native.missing}: the torch path is all there is")
    assert native.module is not None, native.error


def shared_step(page: int, hq: int, hkv: int, d: int, shared_blocks: int, tails: list[int],
                others: list[int], prefill: int, seed: int, consecutive: bool = False,
                prompts: tuple[tuple[int, int], ...] = ()):
    """len(tails) requests whose tables start with the same `shared_blocks` blocks, then tails[i]
    positions of their own (the newest being this step's), `others` requests sharing nothing
    (their lengths), and with `prefill` > 0 one request of that many new tokens: a mixed step;
    the shared blocks anywhere in the pool, or with `consecutive` one after the other; then
    `prompts`, requests behind the same shared blocks with (cached positions of their own after
    them, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    own = [-(-t // page) for t in tails] + [-(-n // page) for n in others]
    own.append(-(-prefill // page))
    own += [-(-(c + n) // page) for c, n in prompts]
    pool = torch.randperm(shared_blocks + sum(own) + 2, generator=gen).tolist()
    if consecutive:  # blocks 1 .. shared_blocks, the rest shuffled
        common = list(range(1, shared_blocks + 1))
        pool = [b for b in pool if b not in common]
    else:
        common = [pool.pop() for _ in range(shared_blocks)]
    spans = ([(shared_blocks * page + t - 1, 1) for t in tails] + [(n - 1, 1) for n in others]
             + ([(0, prefill)] if prefill else [])
             + [(shared_blocks * page + c, n) for c, n in prompts])
    sharing = set(range(len(tails))) | set(range(len(spans) - len(prompts), len(spans)))
    tables = torch.full((len(spans), shared_blocks + max(own) + 1), -1, dtype=torch.int32)
    for b, (c, n) in enumerate(spans):
        first = common if b in sharing else []
        blocks = first + [pool.pop() for _ in range(-(-(c + n) // page) - len(first))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
    meta = AttentionMetadata.for_spans(spans, tables, page)
    total = (shared_blocks + sum(own) + 2) * page
    t = sum(n for _, n in spans)
    return [torch.randn(*shape, generator=gen) for shape in
            [(t, hq, d), (t, hkv, d), (t, hkv, d), (total, hkv, d), (total, hkv, d)]] + [meta]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill,consecutive", [(0, False), (40, False), (0, True)])
@pytest.mark.parametrize("page,hq,hkv,d", [(16, 9, 3, 64), (16, 8, 8, 64), (32, 8, 2, 128)])
def test_shared_prefix_rows_match_the_kernel_row_by_row(monkeypatch, dtype, prefill,
                                                        consecutive, page, hq, hkv, d):
    # a tail of one position (the newest), of a whole block...: 24 rows
    tails = [1, 5, 16, 17, 40, 33] * 4
    monkeypatch.setattr(cascade, "MIN_PAIRS", EVERY_GROUP)
    q, k, v, k_cache, v_cache, meta = shared_step(page, hq, hkv, d, 512 // page, tails,
                                                  [300, 20, 700], prefill, seed=hq + d + prefill,
                                                  consecutive=consecutive)
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    scale = d**-0.5
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    monkeypatch.setenv("TOKENLINE_CASCADE", "1")
    backend = TorchBackend(use_native=True, use_native_prefill=True)
    got = backend.forward(q, k, v, *caches[0], meta, scale)
    plan = backend._plan
    assert len(plan.cascades) == 1  # the 24 rows, over their 512 shared positions
    c = plan.cascades[0]
    assert c.requests.tolist() == list(range(len(tails)))
    assert c.shared_ids.numel() == 512 // page
    assert c.shared_start == (1 if consecutive else None)  # read in place, or gathered
    assert plan.rest_rows.tolist() == [24, 25, 26]  # the others: the kernel as before
    monkeypatch.setenv("TOKENLINE_CASCADE", "0")
    kernel = TorchBackend(use_native=True, use_native_prefill=True)
    want = kernel.forward(q, k, v, *caches[1], meta, scale)
    assert not kernel._plan.cascades
    plain = TorchBackend().forward(q, k, v, *caches[2], meta, scale)
    for cache in caches[1:]:  # the step's new K/V written the same way
        assert torch.equal(caches[0][0], cache[0]) and torch.equal(caches[0][1], cache[1])
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    rows = meta.query_start_loc[:-1].long()[: len(tails) + 3]
    torch.testing.assert_close(got[rows], want[rows], **tol)
    torch.testing.assert_close(got[rows], plain[rows], **tol)
    torch.testing.assert_close(got, want, **tol)  # the prefill's rows too


def test_short_or_small_groups_and_windows_stay_in_the_kernel(monkeypatch):
    monkeypatch.setenv("TOKENLINE_CASCADE", "1")
    # 3 rows over 512 shared positions: too few rows
    *_, meta = shared_step(16, 9, 3, 64, 32, [1, 2, 3], [50], 0, seed=1)
    assert cascade.plan_cascades(meta, [0, 1, 2, 3], [0, 1, 2, 3], torch.float32) == []
    # 5 rows over 240 shared positions: too short a prefix
    *_, meta = shared_step(16, 9, 3, 64, 15, [1, 2, 3, 4, 5], [], 0, seed=2)
    assert cascade.plan_cascades(meta, list(range(5)), list(range(5)), torch.float32) == []
    # 16 rows over 2,048 positions: a group in bfloat16 (32K pairs: no; 48K from 3,072), not
    # in float32 (from 96K)
    for shared, dtype, groups in [(128, torch.bfloat16, 0), (192, torch.bfloat16, 1),
                                  (192, torch.float32, 0)]:
        *_, meta = shared_step(16, 9, 3, 64, shared, list(range(1, 17)), [], 0, seed=4)
        got = cascade.plan_cascades(meta, list(range(16)), list(range(16)), dtype)
        assert len(got) == groups, (shared, dtype)
    # a sliding-window layer: every row through the kernel, the same numbers as without
    monkeypatch.setattr(cascade, "MIN_PAIRS", EVERY_GROUP)
    q, k, v, k_cache, v_cache, meta = shared_step(16, 9, 3, 64, 32, [1, 9, 20, 33], [100], 0,
                                                  seed=3)
    backend = TorchBackend(use_native=True, use_native_prefill=True)
    got = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125, window=64)
    assert backend._plan.cascades  # planned for the step, not used by this layer
    monkeypatch.setenv("TOKENLINE_CASCADE", "0")
    want = TorchBackend(use_native=True, use_native_prefill=True).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125, window=64)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    monkeypatch.setenv("TOKENLINE_CASCADE", "yes")
    with pytest.raises(ValueError, match="TOKENLINE_CASCADE must be 0 or 1, not 'yes'"):
        cascade.enabled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("consecutive", [False, True])
def test_prompts_behind_a_shared_prefix_match_the_kernels(monkeypatch, dtype, consecutive):
    """A burst's questions after one document: their new tokens attend the shared blocks once,
    stacked, and their own positions causally (with a cached tail of their own, or none), the
    same numbers as the prefill kernel's and the plain-torch path's; decode rows beside them."""
    monkeypatch.setattr(cascade, "MIN_PAIRS", EVERY_GROUP)
    prompts = ((0, 20), (0, 47), (5, 16), (30, 33), (16, 2))
    q, k, v, k_cache, v_cache, meta = shared_step(16, 9, 3, 64, 20, [1, 3, 7, 20], [50], 0,
                                                  seed=9, consecutive=consecutive,
                                                  prompts=prompts)
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    monkeypatch.setenv("TOKENLINE_CASCADE", "1")
    backend = TorchBackend(use_native=True, use_native_prefill=True)
    got = backend.forward(q, k, v, *caches[0], meta, 0.125)
    plan = backend._plan
    assert len(plan.extend_cascades) == 1 and len(plan.extend_cascades[0].spans) == 5
    assert plan.prefill_rest.numel() == 0 and len(plan.cascades) == 1
    monkeypatch.setenv("TOKENLINE_CASCADE", "0")
    want = TorchBackend(use_native=True, use_native_prefill=True).forward(
        q, k, v, *caches[1], meta, 0.125)
    plain = TorchBackend().forward(q, k, v, *caches[2], meta, 0.125)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got, plain, **tol)
