"""Several workloads in one `tokenline bench peers` run, and the table of ratios they end with.

    tokenline bench peers --peer vllm --suite long --rounds 3 [--dtype bfloat16]
    tokenline bench peers --peer vllm --suite shared-doc,long-4k --rounds 3

Each workload is a whole `bench peers` pass of its own (every system on a fresh server, the
systems alternating, `--rounds` rounds, its own report); the table at the end has a row per
workload and peer, each round's figure side by side, as issue 45's table has them:

    | workload | dtype | peer | peer tok/s (rounds) | ours tok/s (rounds) | ours/peer (rounds) |
    TTFT p50 peer / ours |

"ours/peer" pairs the rounds (ours in round r over the peer in round r); TTFT is the range of
the rounds' medians, in seconds. Before anything starts, every request's prompt + max_tokens
is checked against each server's context (vLLM's --max-model-len, ours' --max-model-len or
--max-total-tokens when given after --).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

from bench.datasets import SampleRequest, load_jsonl
from bench.long_workloads import WORKLOADS, cold_warmup, suite_workloads

DEFAULT_WORKLOAD = Path(__file__).parent / "workloads" / "mixed64.jsonl"
TABLE_HEAD = ("| workload | dtype | peer | peer tok/s (rounds) | ours tok/s (rounds) "
              "| ours/peer (rounds) | TTFT p50 peer / ours |")


class Workload(NamedTuple):
    label: str
    requests: list[SampleRequest]
    warmup: SampleRequest | None  # None: the first request warms the server up


def load_workloads(workload: str | None, suite: str | None, seed: int,
                   num_prompts: int | None) -> list[Workload]:
    """Each workload to run: the suite's, or the one `workload` names (a generated workload,
    warmed up on a request that shares no prefix with it, or a JSONL file; mixed64.jsonl when
    none)."""
    names = suite_workloads(suite) if suite else [workload or str(DEFAULT_WORKLOAD)]
    out = []
    for name in names:
        if name in WORKLOADS:
            requests = WORKLOADS[name](seed)[:num_prompts]
            label, warmup = f"{name} (seed {seed})", cold_warmup(requests) if requests else None
        else:
            requests, label, warmup = load_jsonl(name, num_prompts), Path(name).name, None
        if not requests:
            raise ValueError(f"{name}: no requests")
        out.append(Workload(label, requests, warmup))
    return out


def _flag(flags: list[str], name: str) -> str | None:
    """The value of `name` in a command line (`--x v` or `--x=v`), the last one given."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def context_limits(args: argparse.Namespace) -> dict[str, int]:
    """The longest request (prompt + max_tokens) each server will take, where it is known."""
    limits = {}
    if args.peer == "vllm":
        limits["vllm --max-model-len"] = args.vllm_max_model_len
    if not args.no_tokenline:
        for name in ("--max-model-len", "--max-total-tokens"):
            value = _flag(args.tokenline_flags, name)
            if value is not None:
                limits[f"tokenline serve {name}"] = int(value)
    return limits


def too_long(workloads: list[Workload],
             limits: dict[str, int]) -> list[str]:
    """What does not fit: a line per workload and server whose longest request exceeds it."""
    problems = []
    for name, requests, _ in workloads:
        longest = max(r.prompt_len + r.max_tokens for r in requests)
        problems += [f"{name}: a request of {longest} tokens (prompt + max_tokens) exceeds "
                     f"{server} {limit}" for server, limit in limits.items() if longest > limit]
    return problems


def warn_llama_slots(args: argparse.Namespace,
                     workloads: list[Workload]) -> None:
    """llama-server gives each of its -np slots -c / np tokens of context (unless its KV is
    unified): say so when a request is longer than that, rather than fail the run for it."""
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    if args.peer != "llama-server" or not slots:
        return
    per_slot = args.ctx // max(slots)
    for name, requests, _ in workloads:
        longest = max(r.prompt_len + r.max_tokens for r in requests)
        if longest > per_slot:
            print(f"warning: {name}: a request of {longest} tokens exceeds llama-server's "
                  f"{per_slot} per slot (-c {args.ctx} -np {max(slots)}); raise --ctx or "
                  "lower --slots if it refuses it", file=sys.stderr)


def dtype_of(args: argparse.Namespace) -> str:
    """Our dtype: --dtype (vLLM's too), else the one given after --, else float32."""
    return args.dtype or _flag(args.tokenline_flags, "--dtype") or "float32"


def _rounds(runs: list[Any], system: str) -> list[Any]:
    return sorted((r for r in runs if r.system == system), key=lambda r: r.extra.get("round", 0))


def _span_s(values_ms: list[float]) -> str:
    low, high = min(values_ms) / 1000, max(values_ms) / 1000
    return f"{low:.1f} s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} s"


def _row(workload: str, dtype: str, peer: str, theirs: list[Any], ours: list[Any]) -> str:
    def rates(runs: list[Any]) -> str:
        return ", ".join(f"{r.tokens_per_s:.1f}" for r in runs) or "-"

    ratios = ", ".join(f"{o.tokens_per_s / t.tokens_per_s:.2f}x"
                       for o, t in zip(ours, theirs, strict=False) if t.tokens_per_s > 0)
    ttft = " / ".join(_span_s([r.median_ttft_ms for r in runs]) if runs else "-"
                      for runs in (theirs, ours))
    return (f"| {workload} | {dtype} | {peer} | {rates(theirs)} | {rates(ours)} | "
            f"{ratios or '-'} | {ttft} |")


def format_suite_table(results: list[tuple[str, list[Any]]], dtype: str, ours: str) -> str:
    """A markdown row per workload and peer (every system other than `ours`; a row with no
    peer where there is none): each round's useful tok/s, our ratio per round, TTFT p50."""
    lines = [TABLE_HEAD, "|---|---|---|---|---|---|---|"]
    for workload, runs in results:
        mine = _rounds(runs, ours)
        peers = [s for s in dict.fromkeys(r.system for r in runs) if s != ours]
        for peer in peers or ["-"]:
            lines.append(_row(workload, dtype, peer, _rounds(runs, peer), mine))
    return "\n".join(lines)


def suite_json(results: list[tuple[str, str, list[dict]]], table: str) -> dict[str, Any]:
    """What --json holds for a suite: each workload's header and runs, and the table."""
    return {"workloads": [{"workload": name, "header": header, "runs": runs}
                          for name, header, runs in results], "table": table}
