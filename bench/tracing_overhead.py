"""What tracing costs: serving throughput with OTLP export on against off, in one run.

Stacks (`tokenline serve`) are started in turn on this machine, alternately without and with
`--otlp-traces-endpoint` (exporting to a local receiver in its own process), each loaded with
the same workload by `bench.serve.run_benchmark`; the ratio of the medians of their output
throughputs is the result (target: at least 0.95). On a machine shared with other work the
throughput of identical runs varies by more than 5%, so it also reports the services' CPU time
per output token, which other load disturbs far less, and the ratio of each back-to-back pair.

    python -m bench.tracing_overhead --dataset-path bench/workloads/mixed64.jsonl \\
        --num-prompts 32 --max-concurrency 16 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.datasets import load_jsonl
from bench.serve import run_benchmark
from bench.servers import TokenlineServer, free_port

REPO = Path(__file__).resolve().parents[1]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Receiver:
    """`python -m bench.otlp_receiver` in its own process, so that decoding spans takes no
    time from the load generator."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.otlp_receiver", "--port", str(self.port)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "OTLP receiver at ...": listening

    def stop(self) -> str:
        _stop(self.proc, signal.SIGINT)
        assert self.proc.stdout is not None
        return self.proc.stdout.read().strip()


def _cpu_seconds(session: int) -> float:
    """CPU time (user + system) of every live process in a session: the stack's services."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session:  # fields[3] is the session id
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def run_stack(flags: list[str], env: dict[str, str], requests, concurrency: int,
              warmup: int) -> dict[str, Any]:
    with TokenlineServer(*flags, env=env) as server:
        url = server.url
        if warmup:  # first forwards pay for allocation and kernel selection
            asyncio.run(run_benchmark(url, requests[:warmup], max_concurrency=concurrency,
                                      ignore_eos=True))
        cpu = _cpu_seconds(server.proc.pid)
        result = asyncio.run(run_benchmark(url, requests, max_concurrency=concurrency,
                                           ignore_eos=True))
        # CPU the services spent per output token: what tracing adds, however busy the
        # machine is with other work (which moves throughput far more)
        result["cpu_ms_per_token"] = 1000 * (_cpu_seconds(server.proc.pid) - cpu) / max(
            1, result["total_output_tokens"])
        return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset-path", default=str(REPO / "bench/workloads/mixed64.jsonl"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2,
                   help="stack pairs (off, on), alternating, so drift hits both alike")
    p.add_argument("--warmup", type=int, default=4, help="requests sent before measuring")
    p.add_argument("--export-delay-ms", type=int, default=5000,
                   help="OTEL_BSP_SCHEDULE_DELAY of the traced stacks (OpenTelemetry's default)")
    p.add_argument("serve_args", nargs="*", help="flags for `tokenline serve` (after --)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    requests = load_jsonl(args.dataset_path, args.num_prompts)
    receiver = Receiver()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        for i in range(args.repeats):
            for mode in ("off", "on"):
                flags = list(args.serve_args)
                env = {}
                if mode == "on":
                    flags += ["--otlp-traces-endpoint", receiver.url]
                    env["OTEL_BSP_SCHEDULE_DELAY"] = str(args.export_delay_ms)
                r = run_stack(flags, env, requests, args.max_concurrency, args.warmup)
                if r["failed"]:
                    print(f"error: {r['failed']} requests failed: {r['first_error']}")
                    return 1
                runs[mode].append(r)
                print(f"run {i + 1} tracing {mode:3}: {r['output_throughput']:8.1f} out tok/s "
                      f"{r['request_throughput']:6.2f} req/s  TTFT p50 "
                      f"{r['median_ttft_ms']:7.1f} ms  TPOT p50 {r['median_tpot_ms']:6.1f} ms  "
                      f"service CPU {r['cpu_ms_per_token']:6.1f} ms/token", flush=True)
    finally:
        received = receiver.stop()
    off = statistics.median(r["output_throughput"] for r in runs["off"])
    on = statistics.median(r["output_throughput"] for r in runs["on"])
    ratio = on / off
    cpu_off = statistics.median(r["cpu_ms_per_token"] for r in runs["off"])
    cpu_on = statistics.median(r["cpu_ms_per_token"] for r in runs["on"])
    print(f"receiver: {received}")
    print(f"output throughput, median of {args.repeats}: off {off:.1f} tok/s, "
          f"on {on:.1f} tok/s; on/off = {ratio:.3f} "
          f"({'meets' if ratio >= 0.95 else 'misses'} the 0.95 target)")
    print(f"service CPU per output token, median: off {cpu_off:.2f} ms, on {cpu_on:.2f} ms; "
          f"off/on = {cpu_off / cpu_on:.3f}")
    # Each pair ran back to back, so a pair's ratio is the least disturbed by other load
    pairs = [b["output_throughput"] / a["output_throughput"]
             for a, b in zip(runs["off"], runs["on"], strict=True)]
    print("on/off per pair: " + ", ".join(f"{r:.3f}" for r in pairs)
          + f"; median {statistics.median(pairs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
