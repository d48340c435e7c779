"""`python -m bench.prefill_attention`: the C++ prefill/extend kernel against torch's SDPA.

Two tables, each side measured alternately in one process (the machine may be shared: compare
the columns of one run):

- attention alone, SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), page 16: one
  fresh prompt of each --lengths, the burst's prefill step (10 prompts of 90-300 tokens) and two
  extends (new tokens after a cached prefix). TorchBackend.forward either way: the kernel
  (paged_prefill_cpu.cpp) or the torch path it replaces (SDPA is_causal on a fresh prompt's
  own k, v; gather + SDPA with a bool mask for an extend), the cache writes of the step's k, v
  included on both sides. GFLOP/s count the causal half only;
- the extend grid (--extends, `cached:new` pairs): n new tokens after c cached, SDPA against the
  kernel, and which of the two the model runner's route (TorchBackend.sdpa: AMX_BF16 in
  bfloat16 where the CPU has AMX, nothing elsewhere) picks for it on this machine;
- with --steps, whole forward passes of the real SmolLM2 (ModelRunner.forward: a 2,048-token
  prefill, that burst step with 20 decodes beside it, a 512-token extend after 1,536 cached, and
  a 6,000-token prompt's three 2,048-token chunks), and the time spent in the attention backend
  (cache writes and decodes included): all in SDPA, all in the kernel, and as routed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/offline.py

import torch  # noqa: E402

from services.scheduler.attention.base import AttentionMetadata  # noqa: E402
from services.scheduler.attention.torch_backend import TorchBackend, prefill_kernels  # noqa: E402
from services.scheduler.executor.model_runner import _sdpa_route  # noqa: E402

HQ, HKV, D, PAGE = 9, 3, 64, 16
BURST = [90, 120, 150, 180, 200, 220, 250, 270, 300, 248]  # a prefill step of the 64-request burst


def _step(spans: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """q, k, v and a cache with the step's k, v written, for requests of (cached, new) tokens
    whose blocks lie shuffled in the pool."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // PAGE) for c, n in spans]
    pool = torch.randperm(sum(need), generator=gen).tolist()
    tables = torch.zeros((len(spans), max(need)), dtype=torch.int32)
    for b in range(len(spans)):
        tables[b, : need[b]] = torch.tensor(pool[sum(need[:b]) : sum(need[: b + 1])])
    meta = AttentionMetadata.for_spans(spans, tables, PAGE)
    tokens, num_slots = sum(meta.query_lens_cpu), sum(need) * PAGE
    q, k, v = (torch.randn(tokens, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    k_cache, v_cache = (torch.randn(num_slots, HKV, D, generator=gen).to(dtype) for _ in "kv")
    k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = k, v
    return q, k, v, k_cache, v_cache, meta


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def attention_table(lengths: list[int], dtypes: list[torch.dtype], repeats: int) -> list[str]:
    cases = [(f"prompt {n}", [(0, n)]) for n in lengths] + [
        ("burst: 10 prompts, 90-300", [(0, n) for n in BURST]),
        ("extend 256 after 512", [(512, 256)]),
        ("extend 3 x 100 after 1000", [(1000, 100)] * 3),
    ]
    lines = ["| dtype | case | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for dtype in dtypes:
        for name, spans in cases:
            args = (*_step(spans, dtype), D**-0.5)
            flops = sum(4 * HQ * D * (n * c + n * (n + 1) / 2) for c, n in spans)
            times = {}
            for native in (False, True, False, True):
                backend = TorchBackend(use_native_prefill=native)
                best = _fastest(lambda b=backend, a=args: b.forward(*a), repeats)
                times[native] = min(times.get(native, best), best)
            sdpa, ours = times[False], times[True]
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {name} | {sdpa * 1e3:.2f} | "
                         f"{ours * 1e3:.2f} | {flops / sdpa / 1e9:.0f} | {flops / ours / 1e9:.0f} "
                         f"| **{sdpa / ours:.2f}x** |")
    return lines


# n new after c cached: around AMX_BF16's crossover (64K pairs, 48 new) and far from it
EXTENDS = "128:128,128:256,1024:100,2048:64,2048:256,1500:16,2048:32"


def extend_table(extends: list[tuple[int, int]], dtypes: list[torch.dtype],
                 repeats: int) -> list[str]:
    lines = ["| dtype | extend | pairs | SDPA ms | kernel ms | SDPA / kernel | the route picks |",
             "|---|---|---|---|---|---|---|"]
    for dtype in dtypes:
        route = _sdpa_route(dtype)
        for c, n in extends:
            args = (*_step([(c, n)], dtype), D**-0.5)
            times = {}
            for native in (False, True, False, True):
                backend = TorchBackend(use_native_prefill=native)
                best = _fastest(lambda b=backend, a=args: b.forward(*a), repeats)
                times[native] = min(times.get(native, best), best)
            picks = "SDPA" if route is not None and route.takes(n, c + n) else "kernel"
            pairs = n * c + n * (n + 1) // 2
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {n} after {c} | "
                         f"{pairs / 1024:.0f}K | {times[False] * 1e3:.2f} | "
                         f"{times[True] * 1e3:.2f} | **{times[False] / times[True]:.2f}** | "
                         f"{picks} |")
    return lines


def step_table(dtypes: list[str], rounds: int) -> list[str]:
    from common.modelstore import prepare_model
    from services.scheduler.executor.model_runner import ModelRunner

    spent = [0.0]
    forward = TorchBackend.forward

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    # (use_native_prefill, the route): all SDPA, all kernel, as the model runner routes
    sides = {"SDPA": (False, None), "kernel": (True, None), "routed": (True, "runner")}
    lines = ["| dtype | step | " + " | ".join(f"{k} step ms" for k in sides) + " | "
             + " | ".join(f"{k} attention ms" for k in sides) + " |",
             "|---|---|" + "---|" * 2 * len(sides)]
    TorchBackend.forward = timed
    try:
        for dtype in dtypes:
            runner = ModelRunner(prepare_model(None), device="cpu", dtype=dtype,
                                 max_total_tokens=8192)

            def requests(contexts: list[int], new: list[int], page=runner.page_size):
                return _requests(page, contexts, new)

            steps = {
                "prefill 2,048": requests([0], [2048]),
                "burst: 10 prompts + 20 decodes": requests(
                    [0] * 10 + [150 + 10 * i for i in range(20)], BURST + [1] * 20),
                "extend 512 after 1,536": requests([1536], [512]),
                # the chunks of one prompt, each after the ones before: three forwards
                "prompt 6,000 in chunks of 2,048": [requests([c], [n]) for c, n in
                                                    ((0, 2048), (2048, 2048), (4096, 1904))],
            }
            for name, chunks in steps.items():
                med = _time_sides(runner, sides, chunks, rounds, spent)
                lines.append(f"| {dtype} | {name} | "
                             + " | ".join(f"{med[k][0]:.0f}" for k in sides) + " | "
                             + " | ".join(f"{med[k][1]:.0f}" for k in sides) + " |")
    finally:
        TorchBackend.forward = forward
    return lines


def _requests(page_size: int, contexts: list[int], new: list[int]) -> tuple[list, list[int]]:
    """One request per (context, new tokens), each `context` tokens already in its own blocks."""
    from common.messages import SamplingParams
    from services.scheduler.core.request import Request

    reqs, block = [], 0
    for b, (ctx, n) in enumerate(zip(contexts, new, strict=True)):
        prompt = [1000 + (7 * i + b) % 30000 for i in range(ctx + n)]
        r = Request(f"r{b}", prompt, SamplingParams(temperature=0.0))
        r.num_computed = ctx
        blocks = -(-(ctx + n) // page_size)
        r.block_table = list(range(block, block + blocks))
        block += blocks
        reqs.append(r)
    return reqs, new


def _time_sides(runner, sides: dict, chunks, rounds: int,
                spent: list[float]) -> dict[str, list[float]]:
    """Median step and attention ms of each side over `rounds` (after one warm-up round), the
    sides alternating within each round."""
    chunks = chunks if isinstance(chunks, list) else [chunks]
    route = runner.backend.sdpa
    seen: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for r in range(rounds + 1):
        for side, (native, routed) in sides.items():
            runner.backend.use_native_prefill = native
            runner.backend.sdpa = route if routed else None
            spent[0] = 0.0
            t = time.perf_counter()
            for reqs, new in chunks:
                runner.forward(reqs, new, [1] + [0] * (len(reqs) - 1))
            if r:  # the first round warms up
                seen[side].append((time.perf_counter() - t, spent[0]))
    runner.backend.use_native_prefill, runner.backend.sdpa = True, route
    return {k: [statistics.median(x[i] for x in v) * 1e3 for i in (0, 1)]
            for k, v in seen.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,256,512,2048",
                        help="comma-separated prompt lengths")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="calls per side (fastest kept)")
    parser.add_argument("--extends", default=EXTENDS,
                        help="comma-separated cached:new pairs for the extend grid ('' skips it)")
    parser.add_argument("--steps", action="store_true", help="also whole SmolLM2 steps")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of --steps")
    args = parser.parse_args(argv)
    native = prefill_kernels()
    if native.module is None:
        parser.error(f"no C++ prefill kernel here: {native.missing or native.error}")
    dtypes = args.dtype.split(",")
    try:
        extends = [tuple(int(v) for v in pair.split(":")) for pair in args.extends.split(",")
                   if pair]
    except ValueError:
        parser.error(f"--extends: cached:new pairs of integers, not {args.extends!r}")
    if any(len(e) != 2 or e[0] < 1 or e[1] < 2 for e in extends):
        parser.error(f"--extends: each pair is cached (>= 1) : new (>= 2), not {args.extends!r}")
    lines = attention_table([int(n) for n in args.lengths.split(",")],
                            [getattr(torch, d) for d in dtypes], args.repeats)
    if extends:
        lines += [""] + extend_table(extends, [getattr(torch, d) for d in dtypes], args.repeats)
    if args.steps:
        lines += [""] + step_table(dtypes, args.rounds)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
