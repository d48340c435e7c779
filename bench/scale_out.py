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
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from bench.datasets import load_jsonl
from bench.serve import run_benchmark
from services.launcher.nats import NatsServer, free_port

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "mixed64.jsonl"


@contextmanager
def stack(num_schedulers: int, threads: int, kv_tokens: int, extra: list[str]):
    """NATS, one gateway/tokenizer/detokenizer and `num_schedulers` schedulers; yields the URL."""
    nats = NatsServer().start()
    port = free_port()
    flags = ["--nats-url", nats.url, "--port", str(port), *extra]
    per = max(1, threads // num_schedulers)
    sched_flags = ["--num-threads", str(per),
                   "--max-total-tokens", str(kv_tokens // num_schedulers)]
    logdir = Path(tempfile.mkdtemp(prefix="tokenline-scale-out-"))
    procs = []
    names = ["gateway", "tokenizer", "detokenizer"] + ["scheduler"] * num_schedulers
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for i, name in enumerate(names):
        argv = flags + (sched_flags if name == "scheduler" else [])
        log = open(logdir / f"{name}-{i}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", f"services.{name}", *argv],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_schedulers(url, num_schedulers, timeout=300)
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        nats.stop()


def _wait_schedulers(url: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/get_server_info", timeout=2) as r:
                if len(json.loads(r.read()).get("schedulers", [])) >= n:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} schedulers not up at {url} after {timeout}s")


async def measure(url: str, requests, warmup) -> dict:
    await run_benchmark(url, warmup, ignore_eos=True)  # first forwards: allocation, kernels
    return await run_benchmark(url, requests, ignore_eos=True)


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """The machine the configurations share, rounds, and where results go."""
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV pool, all schedulers")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--result-json")
    p.add_argument("--server-flag", action="append", default=[],
                   help="one more flag for every service (repeat)")


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
    configs = [("1 scheduler", 1), ("2 schedulers", 2)]
    rows = []
    for rnd in range(args.rounds):
        for label, n in configs if rnd % 2 == 0 else configs[::-1]:
            with stack(n, args.threads, args.kv_tokens, args.server_flag) as url:
                res = asyncio.run(measure(url, requests, warmup))
            per = max(1, args.threads // n)
            row = {"config": f"{label} x {per} thread{'s' if per > 1 else ''}", "round": rnd,
                   **{k: res[k] for k in (
                       "duration", "completed", "failed", "request_throughput",
                       "output_throughput", "total_token_throughput", "mean_ttft_ms",
                       "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")}}
            rows.append(row)
            print(f"{row['config']:<26} round {rnd}: {row['duration']:6.1f} s  "
                  f"{row['output_throughput']:6.1f} out tok/s  "
                  f"{row['total_token_throughput']:7.1f} total tok/s  "
                  f"TTFT mean {row['mean_ttft_ms']:7.0f} ms  "
                  f"TPOT mean {row['mean_tpot_ms']:5.0f} ms  failed {row['failed']}",
                  flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
