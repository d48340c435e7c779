"""Cache-aware routing against random, two schedulers, measured in one run; one scheduler too.

Each configuration gets a fresh stack on a local nats-server (`bench.scale_out.stack`: one
gateway, tokenizer and detokenizer, and the schedulers) and the same multi-turn workload
through `run_benchmark` (what `tokenline bench serve --dataset-name conversations` runs):

    python -m bench.routing --conversations 16 --result-json out.json

One scheduler gets all `--threads` torch threads and the whole KV pool; each of two gets half
of both, so every configuration has the same machine. The one-scheduler run is the cache hit
rate to match: there every turn finds its history. Rounds alternate the order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.datasets import load_conversations, load_jsonl
from bench.scale_out import add_stack_args, measure, stack

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "multiturn32x6.jsonl"
WARMUP = REPO / "bench" / "workloads" / "mixed64.jsonl"
CONFIGS = {"random": ("2 schedulers, random", 2, "random"),
           "cache_aware": ("2 schedulers, cache_aware", 2, "cache_aware"),
           "one": ("1 scheduler", 1, "cache_aware")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-path", default=str(WORKLOAD))
    p.add_argument("--conversations", type=int, help="the first N (default: all)")
    p.add_argument("--configs", default="random,cache_aware,one",
                   help="which to run, comma-separated: random, cache_aware, one (1 scheduler)")
    add_stack_args(p)
    args = p.parse_args(argv)
    requests = load_conversations(args.dataset_path, args.conversations)
    first_turn = [i == 0 or r.conversation != requests[i - 1].conversation
                  for i, r in enumerate(requests)]
    warmup = load_jsonl(WARMUP, 2)
    for w in warmup:
        w.max_tokens = 4
    names = [c.strip() for c in args.configs.split(",")]
    if unknown := [c for c in names if c not in CONFIGS]:
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    configs = [CONFIGS[c] for c in names]
    rows = []
    for rnd in range(args.rounds):
        for label, n, method in configs if rnd % 2 == 0 else configs[::-1]:
            flags = ["--load-balance-method", method, *args.server_flag]
            with stack(n, args.threads, args.kv_tokens, flags) as url:
                res = asyncio.run(measure(url, requests, warmup))
            row = {"config": label, "round": rnd, **{k: res[k] for k in (
                "duration", "completed", "failed", "total_input_tokens", "total_cached_tokens",
                "cache_hit_rate", "request_throughput", "output_throughput",
                "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")}}
            row["recomputed_tokens"] = row["total_input_tokens"] - row["total_cached_tokens"]
            # later turns alone: the first turns of a burst all compute the system prompt
            # wherever they go (nothing is cached yet), which routing cannot change
            row["recomputed_later_turns"] = sum(
                n - c for i, (n, c) in enumerate(zip(res["input_lens"], res["cached_lens"],
                                                     strict=True)) if not first_turn[i])
            rows.append(row)
            print(f"{label:<26} round {rnd}: {row['duration']:6.1f} s  hit rate "
                  f"{row['cache_hit_rate']:.3f}  recomputed {row['recomputed_tokens']:6d} "
                  f"({row['recomputed_later_turns']} after first turns)  "
                  f"TTFT p50 {row['median_ttft_ms']:7.0f} ms p99 {row['p99_ttft_ms']:7.0f} ms  "
                  f"{row['request_throughput']:.2f} req/s  "
                  f"{row['total_token_throughput']:7.1f} total tok/s  failed {row['failed']}",
                  flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
