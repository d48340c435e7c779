"""LoRA adapters against the base model, on one `tokenline serve`, in one run.

    tokenline bench lora --adapters 4 --rank 16 --rounds 2

Makes `--adapters` PEFT adapters of rank `--rank` on q/k/v/o (the first also on the MLP) over
the served model with `peft` itself (random non-zero B, so each changes the output; peft is a
test dependency: `make test` installs it), starts one `tokenline serve --lora-paths ...`, and
sends the same workload twice per round, alternating: every request to the base, and the
requests spread round-robin over the adapters. Then one request at a time (the first
`--single` requests), to the base and to one adapter, for a single user's TPOT. The prefix
cache is flushed before each run. Ratios are adapters over base, of the medians over rounds:
throughput at the workload's concurrency, TPOT at one.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.datasets import SampleRequest, load_jsonl
from bench.serve import run_benchmark
from bench.servers import TokenlineServer

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "bench" / "workloads" / "mixed64.jsonl"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` PEFT adapters over `model_dir`, saved under `out`: name -> directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i in range(count):
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        targets = ATTENTION + (MLP if i == 0 else [])
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules=targets))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        paths[f"adapter{i}"] = out / f"adapter{i}"
        model.save_pretrained(str(paths[f"adapter{i}"]))
    return paths


def saved_adapters(model_dir: Path, out: Path, count: int, rank: int) -> dict[str, Path] | None:
    """The adapters `make_adapters` saved under `out` before for this model and rank, or None
    when any is missing or was made for another model or rank."""
    paths = {f"adapter{i}": out / f"adapter{i}" for i in range(count)}
    for path in paths.values():
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return None
        if (config.get("r"), config.get("base_model_name_or_path")) != (rank, str(model_dir)):
            return None
    return paths


def adapters_at(model_dir: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` adapters of rank `rank` under `out`: those saved there before, else made."""
    return saved_adapters(model_dir, out, count, rank) or make_adapters(model_dir, out, count,
                                                                        rank)


def spread(requests: list[SampleRequest], names: list[str | None]) -> list[SampleRequest]:
    """Copies of `requests`, request i sent to names[i % len(names)] (None: the base)."""
    out = [copy.copy(r) for r in requests]
    for i, r in enumerate(out):
        r.model = names[i % len(names)]
    return out


def _row(label: str, rnd: int, res: dict[str, Any]) -> dict[str, Any]:
    row = {"config": label, "round": rnd, "duration": res["duration"],
           "output_throughput": res["output_throughput"],
           "median_tpot_ms": res["median_tpot_ms"], "median_ttft_ms": res["median_ttft_ms"],
           "completed": res["completed"]}
    print(f"{label:<34} round {rnd}: {row['output_throughput']:7.1f} out tok/s  "
          f"TPOT p50 {row['median_tpot_ms']:6.1f} ms  TTFT p50 {row['median_ttft_ms']:7.0f} ms",
          flush=True)
    return row


def flush_cache(url: str, path: str = "/flush_cache", tries: int = 20) -> None:
    """Every run starts from an empty prefix cache: the same prompts come back each round.
    `path` is the server's route (ours /flush_cache, vLLM's /reset_prefix_cache); a server that
    answers {"success": false} (vLLM's, while blocks are still held) is asked again."""
    import time
    import urllib.request

    for _ in range(tries):
        with urllib.request.urlopen(urllib.request.Request(f"{url}{path}", method="POST"),
                                    timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {path}: {r.status}")
            body = r.read()
        if json.loads(body or b"{}").get("success", True) is not False:
            return
        time.sleep(0.5)
    raise RuntimeError(f"POST {path}: the cache was not flushed after {tries} tries")


def measure(url: str, configs: list[tuple[str, list[SampleRequest], int | None]],
            rounds: int) -> list[dict[str, Any]]:
    rows = []
    for rnd in range(rounds):
        for label, reqs, conc in configs if rnd % 2 == 0 else configs[::-1]:
            flush_cache(url)
            res = asyncio.run(run_benchmark(url, reqs, max_concurrency=conc, ignore_eos=True))
            if res["completed"] != len(reqs) or res.get("first_error"):
                raise RuntimeError(f"{label}: {res['completed']}/{len(reqs)} completed, "
                                   f"first error {res.get('first_error')}")
            rows.append(_row(label, rnd, res))
    return rows


def ratios(rows: list[dict[str, Any]], n: int) -> dict[str, float]:
    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["config"] == label)

    return {"throughput, adapters / base": med(f"{n} adapters", "output_throughput")
            / med("base", "output_throughput"),
            "1 request TPOT p50, adapter / base": med("1 at a time, adapter0", "median_tpot_ms")
            / med("1 at a time, base", "median_tpot_ms")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenline bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="transformers directory or GGUF (default: SmolLM2's)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dataset-path", default=str(WORKLOAD))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--single", type=int, default=4,
                   help="requests sent one at a time to the base and to an adapter")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-json")
    p.add_argument("--server-flag", action="append", default=[],
                   help="one more flag for `tokenline serve` (repeat)")
    args = p.parse_args(argv)
    if min(args.adapters, args.rank, args.num_prompts, args.single, args.rounds) < 1:
        p.error("--adapters, --rank, --num-prompts, --single, --rounds: at least 1")
    from common.modelstore import prepare_model

    model_dir = prepare_model(args.model)
    requests = load_jsonl(args.dataset_path, args.num_prompts)
    with tempfile.TemporaryDirectory(prefix="tokenline-lora-") as tmp:
        paths = make_adapters(model_dir, Path(tmp), args.adapters, args.rank)
        names: list[str | None] = list(paths)
        configs = [("base", spread(requests, [None]), None),
                   (f"{args.adapters} adapters", spread(requests, names), None),
                   ("1 at a time, base", spread(requests[:args.single], [None]), 1),
                   ("1 at a time, adapter0", spread(requests[:args.single], ["adapter0"]), 1)]
        flags = ["--model", str(model_dir), "--lora-paths",
                 *(f"{n}={d}" for n, d in paths.items()), "--max-lora-rank", str(args.rank),
                 "--max-loras-per-batch", str(args.adapters), *args.server_flag]
        with TokenlineServer(*flags) as server:
            asyncio.run(run_benchmark(server.url, requests[:2], ignore_eos=True))  # warm-up
            rows = measure(server.url, configs, args.rounds)
    out = ratios(rows, args.adapters)
    print("; ".join(f"{k}: {v:.3f}" for k, v in out.items()))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"rows": rows, "ratios": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
