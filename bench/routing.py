"""Cache-aware routing against random, two schedulers, measured in one run; one scheduler too.

Each configuration gets a fresh stack on a local nats-server (`bench.servers.service_stack`: one
gateway, tokenizer and detokenizer, and the schedulers) and the same multi-turn workload
through `run_benchmark` (what `tokenline bench serve --dataset-name conversations` runs):

    python -m bench.routing --conversations 16 --result-json out.json
    python -m bench.routing --workload shared-doc --rounds 3 \
        --configs one,cache_aware,random,one_of_two

One scheduler gets all `--threads` torch threads and the whole KV pool; each of two gets half
of both, so every configuration has the same machine. The one-scheduler run is the cache hit
rate to match: there every turn finds its history. Rounds alternate the order.

`--workload` sends one of `bench.long_workloads`' instead (generated from `--seed`; the
shared-document burst is the case issue 45 asked about: with two schedulers it finds the
document cached nowhere, so routing decides how many times it is computed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.datasets import SampleRequest, load_conversations, load_jsonl
from bench.long_workloads import WORKLOADS
from bench.servers import add_stack_args, compare_stacks

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "multiturn32x6.jsonl"
WARMUP = REPO / "bench" / "workloads" / "mixed64.jsonl"
# name: (label, schedulers, --load-balance-method, share of the machine)
CONFIGS = {"random": ("2 schedulers, random", 2, "random", 1.0),
           "cache_aware": ("2 schedulers, cache_aware", 2, "cache_aware", 1.0),
           "one": ("1 scheduler", 1, "cache_aware", 1.0),
           # what one of the two schedulers does when a router sends it the whole burst (as
           # routing by the prefixes sent, SGLang's, would a shared-document burst: the
           # other one idle): one scheduler on half the threads and half the KV pool
           "one_of_two": ("1 of 2 schedulers, all", 1, "cache_aware", 0.5)}


def _workload(args: argparse.Namespace) -> tuple[list[SampleRequest], list[bool]]:
    """The requests, and which of them start a conversation (every one of a plain workload)."""
    if args.workload:
        requests = WORKLOADS[args.workload](args.seed)
    else:
        requests = load_conversations(args.dataset_path, args.conversations)
    first_turn = [i == 0 or r.conversation is None
                  or r.conversation != requests[i - 1].conversation
                  for i, r in enumerate(requests)]
    return requests, first_turn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-path", default=str(WORKLOAD))
    p.add_argument("--conversations", type=int, help="the first N (default: all)")
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a generated workload of bench.long_workloads instead of the dataset")
    p.add_argument("--seed", type=int, default=0, help="--workload: its seed")
    p.add_argument("--configs", default="random,cache_aware,one",
                   help="which to run, comma-separated: random, cache_aware, one (1 scheduler), "
                   "one_of_two (1 scheduler on half the threads and KV pool: the burst routed "
                   "all to one of two schedulers)")
    add_stack_args(p)
    args = p.parse_args(argv)
    requests, first_turn = _workload(args)
    warmup = load_jsonl(WARMUP, 2)
    for w in warmup:
        w.max_tokens = 4
    names = [c.strip() for c in args.configs.split(",")]
    if unknown := [c for c in names if c not in CONFIGS]:
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    configs = [(label, n, ["--load-balance-method", method], share)
               for label, n, method, share in (CONFIGS[c] for c in names)]

    def row(label: str, rnd: int, res: dict[str, Any]) -> dict[str, Any]:
        out = {"config": label, "round": rnd, **{k: res[k] for k in (
            "duration", "completed", "failed", "total_input_tokens", "total_cached_tokens",
            "cache_hit_rate", "request_throughput", "output_throughput",
            "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")}}
        out["recomputed_tokens"] = out["total_input_tokens"] - out["total_cached_tokens"]
        # later turns alone: the first turns of a burst all compute the system prompt
        # wherever they go (nothing is cached yet), which routing cannot change
        out["recomputed_later_turns"] = sum(
            n - c for i, (n, c) in enumerate(zip(res["input_lens"], res["cached_lens"],
                                                 strict=True)) if not first_turn[i])
        print(f"{label:<26} round {rnd}: {out['duration']:6.1f} s  hit rate "
              f"{out['cache_hit_rate']:.3f}  recomputed {out['recomputed_tokens']:6d} "
              f"({out['recomputed_later_turns']} after first turns)  "
              f"TTFT p50 {out['median_ttft_ms']:7.0f} ms p99 {out['p99_ttft_ms']:7.0f} ms  "
              f"{out['request_throughput']:.2f} req/s  "
              f"{out['output_throughput']:6.1f} out tok/s  "
              f"{out['total_token_throughput']:7.1f} total tok/s  failed {out['failed']}",
              flush=True)
        return out

    compare_stacks(args, configs, requests, warmup, row)
    return 0

if __name__ == "__main__":
    sys.exit(main())
