"""Prefix-cache benchmark: 32 requests sharing a 1,500-token system prompt, median TTFT with the
cache on against `--disable-prefix-cache`, two stacks started in turn in one run.

    python -m bench.prefix_cache [--max-concurrency 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.datasets import load_jsonl
from bench.serve import run_benchmark
from bench.servers import TokenlineServer

WORKLOAD = Path(__file__).parent / "workloads" / "shared_prefix32.jsonl"


def measure(flags: list[str], concurrency: int) -> dict:
    requests = load_jsonl(WORKLOAD)
    with TokenlineServer(*flags) as stack:
        t0 = time.perf_counter()
        result = asyncio.run(run_benchmark(stack.url, requests, max_concurrency=concurrency,
                                           ignore_eos=True, percentiles=(50, 99)))
        result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    on = measure([], args.max_concurrency)
    off = measure(["--disable-prefix-cache"], args.max_concurrency)
    ratio = off["median_ttft_ms"] / on["median_ttft_ms"]
    rows = [("prefix cache on", on), ("--disable-prefix-cache", off)]
    print(f"{'':24} {'median TTFT ms':>15} {'p99 TTFT ms':>12} {'out tok/s':>10} {'wall s':>8}")
    for name, r in rows:
        print(f"{name:24} {r['median_ttft_ms']:15.1f} {r['p99_ttft_ms']:12.1f} "
              f"{r['output_throughput']:10.1f} {r['wall_s']:8.1f}")
    print(f"median TTFT ratio (off / on): {ratio:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"on": on, "off": off, "ratio": ratio},
                                              default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
