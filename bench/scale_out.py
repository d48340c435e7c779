"""One scheduler against two on the same machine, measured in one run.

Each configuration gets a fresh stack on a local nats-server (one gateway, tokenizer and
detokenizer; only the schedulers differ) and the same workload through `run_benchmark`:

    python -m bench.scale_out --num-prompts 24 --rounds 2 --result-json out.json

`--threads T` is the machine's compute: one scheduler uses all T torch threads, each of two
uses T/2, so both configurations get the same cores; the KV pool is split the same way. The
rounds alternate the configurations, so a drift in the machine's background load hits both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.datasets import load_jsonl
from bench.servers import add_stack_args, compare_stacks

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "mixed64.jsonl"


def _row(label: str, rnd: int, res: dict[str, Any]) -> dict[str, Any]:
    row = {"config": label, "round": rnd, **{k: res[k] for k in (
        "duration", "completed", "failed", "request_throughput", "output_throughput",
        "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
        "median_tpot_ms")}}
    print(f"{label:<26} round {rnd}: {row['duration']:6.1f} s  "
          f"{row['output_throughput']:6.1f} out tok/s  "
          f"{row['total_token_throughput']:7.1f} total tok/s  "
          f"TTFT mean {row['mean_ttft_ms']:7.0f} ms  "
          f"TPOT mean {row['mean_tpot_ms']:5.0f} ms  failed {row['failed']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-path", default=str(WORKLOAD))
    p.add_argument("--num-prompts", type=int, default=24)
    add_stack_args(p)
    args = p.parse_args(argv)
    requests = load_jsonl(args.dataset_path, args.num_prompts)
    warmup = load_jsonl(args.dataset_path, 4)
    for w in warmup:
        w.max_tokens = 4
    configs = []
    for label, n in (("1 scheduler", 1), ("2 schedulers", 2)):
        per = max(1, args.threads // n)
        configs.append((f"{label} x {per} thread{'s' if per > 1 else ''}", n, []))
    compare_stacks(args, configs, requests, warmup, _row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
