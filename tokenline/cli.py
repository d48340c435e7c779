"""The `tokenline` command: serve, bench, simulate, plan."""

from __future__ import annotations

import importlib
import signal
import sys

COMMANDS = {
    "serve": "services.launcher.__main__",
    "simulate": "bench.simulate",
    "plan": "bench.plan",
}
BENCH = {
    "serve": "bench.serve",
    "offline": "bench.offline",
    "roofline": "bench.roofline",
    "peers": "bench.peers",
    "quality": "bench.quality",
    "profile": "bench.step_profile",
    "nats": "bench.nats_cluster",
    "lora": "bench.lora",
}

USAGE = """usage: tokenline COMMAND [ARGS]

commands:
  serve            start NATS and the four services, serve HTTP (see `tokenline serve -h`)
  bench serve      load-test any OpenAI-compatible server
  bench offline    our engine against transformers baselines, in one run
  bench roofline   this machine's FLOP/s and bandwidth, and the decode-step bound
  bench peers      our whole stack against llama.cpp's llama-server, in one run
  bench quality    perplexity and KL against float32 per --quantization, on a fixed text
  bench profile    one decode and prefill step split into matmuls, attention, norms, Python
  bench nats       one embedded NATS node against a 3-node cluster: throughput, TTFT, ratios
  bench lora       requests spread over LoRA adapters against the same requests to the base
  simulate         step simulator of static, dynamic and continuous batching
  plan             memory planner: weights, KV pool, concurrency
"""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCH:
            print(f"usage: tokenline bench {{{','.join(BENCH)}}} ...", file=sys.stderr)
            return 2
        module, rest = BENCH[rest[0]], rest[1:]
        # SIGTERM unwinds like Ctrl-C: the servers a bench started (each in its own session,
        # so no signal reaches them by itself) are stopped by their `with` blocks, not orphaned
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
