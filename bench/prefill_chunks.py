"""`python -m bench.prefill_chunks`: how the prefill chunk size and step budget change a burst of
long prompts, measured in one process.

Each configuration (`--chunked-prefill-size` / `--max-prefill-tokens`) gets a fresh in-process
engine (`tokenline.offline.Engine`, the scheduler and model worker without the services) on the
same requests: one of `bench.long_workloads`' workloads, all sent at once, every request
generating exactly `--output-tokens` (EOS ignored). Rounds alternate the order of the
configurations, so a drift in the machine's background load hits all of them; the medians of
the rounds are printed last.

    python -m bench.prefill_chunks --workload long-4k --num-prompts 4 --rounds 2 \\
        --configs 256/2048,512/2048,1024/2048,2048/2048,1024/4096
    python -m bench.prefill_chunks --workload shared-doc --num-prompts 32 --output-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the server runs (see bench/offline.py)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # services/scheduler/__main__.py says why

from bench.long_workloads import WORKLOADS, cold_warmup  # noqa: E402


def parse_configs(text: str) -> list[tuple[int, int]]:
    """"CHUNK/BUDGET,..." -> [(chunk, budget), ...]."""
    configs = []
    for item in text.split(","):
        chunk, sep, budget = item.strip().partition("/")
        if not (sep and chunk.isdigit() and budget.isdigit() and int(chunk) and int(budget)):
            raise ValueError(f"{item.strip()!r}: want CHUNK/BUDGET, two positive token counts")
        configs.append((int(chunk), int(budget)))
    return configs


def run_config(model: str | None, dtype: str, chunk: int, budget: int, prompts: list[list[int]],
               output_tokens: int, warmup: list[int], pool_tokens: int | None) -> dict:
    from common.messages import SamplingParams
    from tokenline.offline import Engine

    flags = {"dtype": dtype, "chunked_prefill_size": chunk, "max_prefill_tokens": budget}
    if pool_tokens:
        flags["max_total_tokens"] = pool_tokens
    engine = Engine(model, **flags)
    engine.generate([warmup], SamplingParams(max_new_tokens=2), use_tqdm=False)
    params = SamplingParams(max_new_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    steps0 = engine.core.num_steps
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    if bad := [o.index for o in outs if len(o.token_ids) != output_tokens]:
        raise RuntimeError(f"chunk {chunk} budget {budget}: request {bad[0]} ended early "
                           f"({outs[bad[0]].finish_reason}: {outs[bad[0]].error})")
    ttfts = [o.ttft for o in outs]
    row = {"chunk": chunk, "budget": budget, "wall_s": wall,
           "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
           "steps": engine.core.num_steps - steps0,
           "output_tok_s": len(prompts) * output_tokens / wall}
    del engine, outs
    gc.collect()
    return row


def run_rounds(args: argparse.Namespace, configs: list[tuple[int, int]],
               prompts: list[list[int]], warmup: list[int]) -> list[dict]:
    """Every configuration once a round, the order reversed every other round; prints each
    run and then the medians."""
    rows = []
    for rnd in range(args.rounds):
        for chunk, budget in configs if rnd % 2 == 0 else configs[::-1]:
            row = run_config(args.model, args.dtype, chunk, budget, prompts, args.output_tokens,
                             warmup, args.max_total_tokens)
            rows.append({"round": rnd, **row})
            print(f"round {rnd}  chunk {chunk:5d} budget {budget:5d}: {row['wall_s']:7.2f} s  "
                  f"TTFT p50 {row['ttft_p50_s']:7.2f} s  max {row['ttft_max_s']:7.2f} s  "
                  f"{row['steps']} steps", flush=True)
    print("medians of the rounds:")
    for chunk, budget in configs:
        mine = [r for r in rows if (r["chunk"], r["budget"]) == (chunk, budget)]
        print(f"  chunk {chunk:5d} budget {budget:5d}: "
              f"{statistics.median(r['wall_s'] for r in mine):7.2f} s  TTFT p50 "
              f"{statistics.median(r['ttft_p50_s'] for r in mine):7.2f} s  "
              f"{statistics.median(r['output_tok_s'] for r in mine):7.2f} output tok/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_chunks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="long-4k")
    p.add_argument("--num-prompts", type=int, help="the workload's first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--configs", default="512/2048,2048/2048",
                   help="CHUNK/BUDGET pairs, comma-separated: --chunked-prefill-size / "
                   "--max-prefill-tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", help="default: the packaged SmolLM2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-total-tokens", type=int, help="the KV pool (default: the engine's)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        p.error(f"--configs: {e}")
    requests = WORKLOADS[args.workload](args.seed)[:args.num_prompts]
    prompts = [list(r.prompt) for r in requests]
    warmup = list(cold_warmup(requests).prompt)[:16]  # shares no block with the workload
    print(f"{args.workload}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{args.output_tokens} output tokens each, {args.dtype}", flush=True)
    rows = run_rounds(args, configs, prompts, warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
