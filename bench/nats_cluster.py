"""One embedded NATS node against a 3-node NATS cluster, measured in one run.

    tokenline bench nats --num-prompts 64 --max-tokens 32 --rounds 2
    tokenline bench nats --hops --messages 20000 --rounds 3    # each hop's message rate

Each configuration is a fresh `tokenline serve` (the same services, the same model; only
`--nats-cluster` differs) and the same 64 requests at once through `run_benchmark`. The rounds
alternate the order, so a drift in the machine's background load hits both; the ratios
(cluster / one node) are of the means over rounds. With a cluster each service connects to a
node of its own choosing, so a request's messages may cross a route between nodes: that hop is
what the cluster costs. `--hops` measures each hop's message rate at the limit instead, with
no model (`bench/nats_hops.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.datasets import load_jsonl
from bench.serve import run_benchmark
from bench.servers import TokenlineServer

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "mixed64.jsonl"
CONFIGS = (("1 NATS node", ()), ("3-node NATS cluster", ("--nats-cluster", "3")))
KEYS = ("duration", "completed", "failed", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms")


def _row(label: str, rnd: int, res: dict[str, Any]) -> dict[str, Any]:
    row = {"config": label, "round": rnd, **{k: res[k] for k in KEYS}}
    print(f"{label:<20} round {rnd}: {row['duration']:6.1f} s  "
          f"{row['output_throughput']:6.1f} out tok/s  "
          f"TTFT mean {row['mean_ttft_ms']:7.0f} ms median {row['median_ttft_ms']:7.0f} ms  "
          f"TPOT mean {row['mean_tpot_ms']:5.0f} ms  failed {row['failed']}", flush=True)
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Cluster over one node, of each configuration's mean over rounds."""
    def mean(label: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows if r["config"] == label)

    (one, _), (three, _) = CONFIGS
    return {key: mean(three, key) / mean(one, key)
            for key in ("output_throughput", "mean_ttft_ms", "median_ttft_ms")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenline bench nats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-path", default=str(WORKLOAD))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, help="cap every request's output at this")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-json")
    p.add_argument("--server-flag", action="append", default=[],
                   help="one more flag for `tokenline serve` (repeat), e.g. --model=DIR")
    p.add_argument("--hops", action="store_true",
                   help="each hop's message rate at the limit, one node against the cluster "
                   "(no model, no tokenline serve)")
    p.add_argument("--messages", type=int, default=20000,
                   help="--hops: messages per published hop (a quarter of it per "
                   "acknowledged one)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1 or args.messages < 4:
        p.error("--rounds and --num-prompts: at least 1; --messages: at least 4")
    if args.hops:
        return hop_rates(args)
    requests = load_jsonl(args.dataset_path, args.num_prompts)
    for r in requests:
        r.max_tokens = min(r.max_tokens, args.max_tokens or r.max_tokens)
    warmup = load_jsonl(args.dataset_path, 4)
    for w in warmup:
        w.max_tokens = 4

    async def measure(url: str) -> dict[str, Any]:
        await run_benchmark(url, warmup, ignore_eos=True)  # first forwards: allocation, kernels
        return await run_benchmark(url, requests, ignore_eos=True)

    rows = []
    for rnd in range(args.rounds):
        for label, flags in CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]:
            with TokenlineServer(*flags, *args.server_flag) as server:
                rows.append(_row(label, rnd, asyncio.run(measure(server.url))))
    out = ratios(rows)
    print("cluster / one node: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"rows": rows, "ratios": out}, indent=2))
    return 0


def hop_rates(args: argparse.Namespace) -> int:
    from bench.nats_hops import run, summary

    rows = run(args.messages, args.rounds)
    print("\n".join(summary(rows)))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"hops": rows}, indent=2))
    return 1 if any(r["lost"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
