"""`tokenline bench offline`: our in-process engine against transformers, one workload, one run.

Every request generates exactly its `max_tokens` (greedy, EOS ignored), so each system does the
same work and "useful output tokens" is the sum of the workload's max_tokens. Systems:

    tokenline <batching>         tokenline.Engine (the engine core in-process), for each
                                 --batching mode: continuous, static, dynamic
    transformers generate, B     model.generate on static batches of B requests in workload
                                 order, left-padded; a batch runs until its longest request is
                                 done (the shorter ones' extra tokens are not counted)
    transformers continuous      transformers' own continuous batching (the manager behind
                                 model.generate_batch), with per-request max_new_tokens

All on the same model (float32), the same machine and the same torch threads, in one process,
one after another. Ratios are to the best transformers baseline. The run also times our decode
steps with a full batch (every request decoding, no prefill) against the roofline bound of
bench.roofline at those steps' mean context.

    tokenline bench offline                      # mixed64, everything (about half an hour)
    tokenline bench offline --hf-batch-sizes 8,32 --json out.json
    tokenline bench offline --quick --model DIR  # a few short requests: a smoke test
    tokenline bench offline --json-schema --batching continuous --hf-batch-sizes '' \
        --no-hf-continuous          # every request under a JSON schema vs none, in one run

With --json-schema (a schema file, or a typical built-in one) the continuous engine runs twice,
unconstrained and with every request constrained by the schema; throughput is then output
tokens per second (a constrained request ends when its JSON closes), and the report adds the
grammar mask's time per step at full batch and the schema's compile time, cold and cached.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# libgomp reads this once, when torch loads it. Spinning waiters (its default) make every
# parallel region wait for a descheduled thread whenever another process wants a core: on a
# shared 2-core machine that made each system here 10-50x slower. Sleeping waiters cost little
# on an idle machine. It reaches `tokenline serve` under --with-stack through the environment.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # services/scheduler/__main__.py says why

import torch  # noqa: E402

from bench.datasets import SampleRequest, load_jsonl  # noqa: E402
from bench.roofline import ModelShape, decode_step_bound, measure_machine  # noqa: E402

DEFAULT_WORKLOAD = Path(__file__).parent / "workloads" / "mixed64.jsonl"
BATCHING_MODES = ("continuous", "static", "dynamic")
QUICK_REQUESTS, QUICK_PROMPT, QUICK_OUTPUT = 6, 48, 8
QUICK_POOL_TOKENS = 4096
# --json-schema without a file: the kind of schema an agent sends (nested, arrays, enums)
TYPICAL_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "customer", "items"],
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "object", "required": ["name", "email"],
                     "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                    "vip": {"type": "boolean"}}},
        "items": {"type": "array", "items": {
            "type": "object", "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                           "price": {"type": "number"},
                           "status": {"enum": ["new", "paid", "shipped"]}}}},
    },
}


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Result:
    system: str
    seconds: float
    output_tokens: int  # useful: each request's own max_tokens
    num_requests: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "requests_per_s": self.requests_per_s}


@dataclass
class DecodeTiming:
    """Pure decode steps with `batch` rows, as the engine timed them (forward only)."""

    batch: int
    contexts: list[float] = field(default_factory=list)  # mean KV length per step
    seconds: list[float] = field(default_factory=list)
    mask_seconds: list[float] = field(default_factory=list)  # grammar masks, every row masked


# -- the workload ------------------------------------------------------------------------------
def load_workload(path: str | Path, num_prompts: int | None, tokenizer_json: Path | None,
                  quick: bool) -> list[Request]:
    samples: list[SampleRequest] = load_jsonl(path, num_prompts)
    tok = None
    out = []
    for s in samples:
        if isinstance(s.prompt, str):
            if tok is None:
                from tokenizers import Tokenizer

                assert tokenizer_json is not None
                tok = Tokenizer.from_file(str(tokenizer_json))
            ids = tok.encode(s.prompt, add_special_tokens=True).ids
        else:
            ids = list(s.prompt)
        out.append(Request(ids, s.max_tokens))
    if quick:
        out = [Request(r.prompt_ids[:QUICK_PROMPT], min(r.max_tokens, QUICK_OUTPUT))
               for r in out[:QUICK_REQUESTS]]
    return out


# -- tokenline ---------------------------------------------------------------------------------
def run_tokenline(model: str | None, requests: list[Request], batching: str,
                  engine_flags: dict[str, Any], progress: bool, schema: dict | None = None,
                  ) -> tuple[Result, DecodeTiming, list[list[int]]]:
    from common.messages import SamplingParams, StructuredOutputs
    from tokenline.offline import Engine

    engine = Engine(model, batching=batching, **engine_flags)
    so = StructuredOutputs(json=schema) if schema is not None else None
    params = [SamplingParams(max_new_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                             structured_outputs=so) for r in requests]
    # warm-up (8 tokens: less than a block, so nothing lands in the prefix cache)
    engine.generate([requests[0].prompt_ids[:8]], SamplingParams(max_new_tokens=2), use_tqdm=False)
    timing = DecodeTiming(batch=min(len(requests), engine.args.max_running_requests))
    _record_decode_steps(engine, timing)
    t0 = time.perf_counter()
    outs = engine.generate([r.prompt_ids for r in requests], params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    core = engine.core
    if schema is None:
        bad = [o.index for o in outs if len(o.token_ids) != requests[o.index].max_tokens]
    else:  # a reply that closed its JSON is done; one that failed is a bug here
        bad = [o.index for o in outs if o.finish_reason not in ("stop", "length")]
    if bad:
        raise RuntimeError(f"tokenline {batching}: requests {bad[:5]} did not generate max_tokens"
                           f" ({outs[bad[0]].finish_reason}: {outs[bad[0]].error})")
    extra = {"steps": core.num_steps, "retractions": core.scheduler.num_retractions_total,
             "mean_ttft_s": statistics.fmean(o.ttft or 0.0 for o in outs)}
    name = f"tokenline {batching}"
    if schema is not None:
        name += " + json schema"
        extra["closed_json"] = sum(o.finish_reason == "stop" for o in outs)
        extra["compile"] = compile_times(core, schema)
    result = Result(name, seconds, sum(len(o.token_ids) for o in outs), len(requests), extra)
    tokens = [o.token_ids for o in outs]
    del engine, core
    gc.collect()
    return result, timing, tokens


def _record_decode_steps(engine: Any, timing: DecodeTiming) -> None:
    """Wrap the core's step() to keep the forward time of every full-batch pure decode step."""
    core = engine.core
    step = core.step

    def recording_step() -> list:
        contexts = {r.rid: r.num_tokens for r in core.scheduler.running}
        before = core.last_step
        outs = step()
        s = core.last_step
        if (s is not before and s.num_decode == timing.batch and s.num_prefill_tokens == 0
                and all(rid in contexts for rid in s.scheduled_rids)):
            timing.contexts.append(statistics.fmean(contexts[r] for r in s.scheduled_rids))
            timing.seconds.append(s.forward_s)
            if s.num_masked == timing.batch:
                timing.mask_seconds.append(s.mask_s)
        return outs

    core.step = recording_step


def compile_times(core: Any, schema: dict) -> dict[str, float]:
    """The schema's compile on a fresh compiler (cold), then a lookup of it (cached), in ms."""
    from common.messages import StructuredOutputs
    from services.scheduler.core.grammar import GrammarCompiler

    compiler = GrammarCompiler(core.grammars.backend, timeout_s=60.0)
    times = {}
    for label in ("cold_ms", "cached_ms"):
        t0 = time.perf_counter()
        job = compiler.submit(StructuredOutputs(json=schema))
        compiler.matcher(job)  # waits for the compile
        times[label] = 1000 * (time.perf_counter() - t0)
    compiler.shutdown()
    return times


# -- transformers ------------------------------------------------------------------------------
def load_hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _pad_id(model) -> int:
    for v in (model.generation_config.pad_token_id, model.config.pad_token_id,
              model.generation_config.eos_token_id):
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return 0


@torch.inference_mode()
def run_hf_static(model, requests: list[Request], batch_size: int,
                  progress: bool) -> tuple[Result, list[list[int]]]:
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    pad = _pad_id(model)
    tokens: list[list[int]] = []
    _hf_generate(model, [requests[0].prompt_ids[:8]], 2, pad, GenerationConfig)  # warm-up
    t0 = time.perf_counter()
    batches = range(0, len(requests), batch_size)
    for start in tqdm(batches, desc=f"transformers B={batch_size}", disable=not progress):
        group = requests[start : start + batch_size]
        longest = max(r.max_tokens for r in group)
        out = _hf_generate(model, [r.prompt_ids for r in group], longest, pad, GenerationConfig)
        tokens += [row[: r.max_tokens] for row, r in zip(out, group, strict=True)]
    seconds = time.perf_counter() - t0
    result = Result(f"transformers generate, batch {batch_size}", seconds,
                    sum(r.max_tokens for r in requests), len(requests))
    return result, tokens


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int,
                 config_cls) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # eos_token_id=[]: never stop early, like ignore_eos (None falls back to the model's EOS)
    config = config_cls(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                        pad_token_id=pad)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out[:, width:]
    if new.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {new.shape[1]} tokens, not {new_tokens}")
    return new.tolist()


@torch.inference_mode()
def run_hf_continuous(model, requests: list[Request], max_batch_tokens: int,
                      progress: bool) -> tuple[Result, list[list[int]]]:
    from tqdm.auto import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = 256
    # Sized for the workload: its default sizing reads GPU memory and on CPU allocates (and
    # zeroes) far more than this run can use.
    blocks = sum(-(-(len(r.prompt_ids) + r.max_tokens) // page) for r in requests) + 4
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                  max_batch_tokens=max_batch_tokens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                           eos_token_id=-1, pad_token_id=_pad_id(model))
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        t0 = time.perf_counter()
        rids = [manager.add_request(r.prompt_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
                for r in requests]
        done: dict[str, Any] = {}
        bar = tqdm(total=len(rids), desc="transformers continuous", disable=not progress)
        while len(done) < len(rids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died")
                continue
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"transformers continuous: {out.error}")
                done[out.request_id] = out
                bar.update(1)
        seconds = time.perf_counter() - t0
        bar.close()
    tokens = [list(done[rid].generated_tokens) for rid in rids]
    short = [i for i, (t, r) in enumerate(zip(tokens, requests, strict=True))
             if len(t) != r.max_tokens]
    if short:
        raise RuntimeError(f"transformers continuous: requests {short[:5]} stopped early")
    result = Result("transformers continuous", seconds, sum(r.max_tokens for r in requests),
                    len(requests), {"max_batch_tokens": max_batch_tokens})
    return result, tokens


# -- the whole stack ---------------------------------------------------------------------------
def run_stack(model: str | None, requests: list[Request], engine_flags: dict[str, Any],
              timeout_s: float = 600.0) -> Result:
    """`tokenline serve` in a subprocess, loaded by bench.serve at an unbounded request rate."""
    from bench.peers import serve_workload, useful_tokens
    from bench.servers import TokenlineServer

    flags = ["--model", model] if model else []
    for name, value in engine_flags.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    samples = [SampleRequest(r.prompt_ids, len(r.prompt_ids), r.max_tokens) for r in requests]
    with TokenlineServer(*flags, timeout=timeout_s) as server:
        out = serve_workload(server.url, samples)
    return Result("tokenline serve (whole stack)", out["duration"],
                  useful_tokens(out, samples)[0], len(requests),
                  {"mean_ttft_ms": out.get("mean_ttft_ms")})


# -- the roofline ------------------------------------------------------------------------------
@dataclass
class Machine:
    flops_per_s: float  # float32 torch.matmul (MKL), as bench.roofline measures it
    bytes_per_s: float
    onednn_flops_per_s: float | None  # float32 through oneDNN, what our projections run on


def measure(quick: bool) -> Machine:
    """FLOP/s and bandwidth of this machine, now."""
    if quick:
        flops, bandwidth = measure_machine(matmul_size=512, bandwidth_mib=64, repeats=2)
    else:
        flops, bandwidth = measure_machine()
    return Machine(flops, bandwidth, _onednn_flops(512 if quick else 2048))


def roofline(timing: DecodeTiming, config: dict, machine: Machine) -> dict[str, Any] | None:
    if not timing.seconds:
        return None
    flops, bandwidth, onednn = machine.flops_per_s, machine.bytes_per_s, machine.onednn_flops_per_s
    shape = ModelShape.from_config(config)
    context = statistics.fmean(timing.contexts)
    bound = decode_step_bound(shape, timing.batch, round(context), flops, bandwidth)
    measured = statistics.median(timing.seconds)
    # bench.roofline measures torch.matmul, i.e. MKL; our projections run through oneDNN,
    # which on some CPUs (AMD's) is much faster. The bound at oneDNN's peak is the stricter one.
    strict = decode_step_bound(shape, timing.batch, round(context), max(flops, onednn),
                               bandwidth) if onednn else None
    return {
        "batch": timing.batch,
        "steps": len(timing.seconds),
        "mean_context": context,
        "median_step_ms": measured * 1e3,
        "best_step_ms": min(timing.seconds) * 1e3,
        "bound_ms": bound * 1e3,
        "fraction_of_bound": bound / measured,
        "flops_per_s": flops,
        "bytes_per_s": bandwidth,
        "onednn_flops_per_s": onednn,
        "strict_bound_ms": strict * 1e3 if strict else None,
        "fraction_of_strict_bound": strict / measured if strict else None,
    }


def _onednn_flops(size: int, repeats: int = 5) -> float | None:
    """float32 FLOP/s of a size^3 product through oneDNN's packed linear, best of `repeats`."""
    if not torch.backends.mkldnn.is_available():
        return None
    from services.scheduler.models.layers import onednn_linear, onednn_pack

    x, w = torch.randn(size, size), torch.randn(size, size)
    packed = onednn_pack(w)
    onednn_linear(x, packed, None)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        onednn_linear(x, packed, None)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


# -- report ------------------------------------------------------------------------------------
def format_report(results: list[Result], roof: dict[str, Any] | None, header: str) -> str:
    baselines = [r for r in results if r.system.startswith("transformers")]
    best = max(baselines, key=lambda r: r.tokens_per_s) if baselines else None
    lines = [header, "", f"{'system':<34} {'time s':>8} {'out tok/s':>10} {'req/s':>7} "
             f"{'vs best baseline':>17}"]
    for r in results:
        ratio = f"{r.tokens_per_s / best.tokens_per_s:.2f}x" if best else "-"
        lines.append(f"{r.system:<34} {r.seconds:>8.1f} {r.tokens_per_s:>10.1f} "
                     f"{r.requests_per_s:>7.3f} {ratio:>17}")
    if best:
        lines.append(f"best baseline: {best.system} ({best.tokens_per_s:.1f} tok/s)")
    by_name = {r.system: r for r in results}
    stack, offline = by_name.get("tokenline serve (whole stack)"), by_name.get(
        "tokenline continuous")
    if stack and offline:
        lines.append(f"whole stack: {100 * stack.tokens_per_s / offline.tokens_per_s:.0f}% of the "
                     "offline continuous engine's throughput")
    if roof:
        lines.append(
            f"decode step at batch {roof['batch']} ({roof['steps']} steps, mean context "
            f"{roof['mean_context']:.0f}): median {roof['median_step_ms']:.1f} ms, bound "
            f"{roof['bound_ms']:.1f} ms at {roof['flops_per_s'] / 1e9:.0f} GFLOP/s and "
            f"{roof['bytes_per_s'] / 1e9:.0f} GB/s: {100 * roof['fraction_of_bound']:.0f}% of "
            "the roofline")
        if roof.get("strict_bound_ms"):
            lines.append(
                f"  at oneDNN's float32 peak ({roof['onednn_flops_per_s'] / 1e9:.0f} GFLOP/s, what "
                f"our projections run on) the bound is {roof['strict_bound_ms']:.1f} ms: "
                f"{100 * roof['fraction_of_strict_bound']:.0f}% of that")
    else:
        lines.append("decode step: no pure full-batch decode step to time")
    plain, constrained = by_name.get("tokenline continuous"), next(
        (r for r in results if r.system.endswith("+ json schema")), None)
    if constrained:
        c = constrained.extra
        if plain:
            share = 100 * constrained.tokens_per_s / plain.tokens_per_s
            lines.append(f"json schema on every request: {share:.0f}% of the unconstrained "
                         "throughput (output tokens/s)")
        lines.append(f"  {c['closed_json']}/{constrained.num_requests} replies closed their JSON "
                     "before max_tokens")
        if c.get("mask_ms_median") is not None:
            lines.append(f"  grammar mask at batch {c['mask_batch']}: median "
                         f"{c['mask_ms_median']:.2f} ms per step ({c['mask_steps']} steps)")
        lines.append(f"  compile of the schema: {c['compile']['cold_ms']:.1f} ms cold, "
                     f"{c['compile']['cached_ms']:.3f} ms cached")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenline bench offline",
        description="Our in-process engine against transformers on one workload, in one run.",
    )
    p.add_argument("--model", help="transformers directory or GGUF (default SmolLM2)")
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                   help="JSONL with prompt_token_ids (or prompt) and max_tokens per line")
    p.add_argument("--num-prompts", type=int, help="only the first N requests")
    p.add_argument("--batching", default=",".join(BATCHING_MODES),
                   help="our batching modes to run, comma-separated ('' for none)")
    p.add_argument("--hf-batch-sizes", default="1,8,32",
                   help="transformers generate static batch sizes ('' for none)")
    p.add_argument("--no-hf-continuous", action="store_true",
                   help="skip transformers' continuous batching")
    p.add_argument("--hf-max-batch-tokens", type=int, default=2048,
                   help="transformers continuous: tokens per step (ours: --max-prefill-tokens)")
    p.add_argument("--threads", type=int, help="torch threads for every system")
    p.add_argument("--json-schema", nargs="?", const="typical", metavar="FILE",
                   help="also run the continuous engine with every request under this JSON "
                   "schema (no FILE: a typical nested one) and compare")
    p.add_argument("--with-stack", action="store_true",
                   help="also `tokenline serve` under `bench serve` at an unbounded rate, right "
                   "after the offline continuous run")
    e = p.add_argument_group("engine flags (tokenline)")
    e.add_argument("--dtype", help="ours only (the baselines stay float32): float32 or bfloat16")
    for flag in ("max-total-tokens", "max-running-requests", "chunked-prefill-size",
                 "max-prefill-tokens", "page-size"):
        e.add_argument(f"--{flag}", type=int)
    p.add_argument("--quick", action="store_true",
                   help=f"the first {QUICK_REQUESTS} requests, prompts cut to {QUICK_PROMPT} "
                   f"tokens, at most {QUICK_OUTPUT} new tokens: a smoke test")
    p.add_argument("--progress", action="store_true", help="progress bars")
    p.add_argument("--json", help="write every result here")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _printed(result: Result) -> Result:
    print(f"  {result.system}: {result.seconds:.1f} s, {result.tokens_per_s:.1f} tok/s",
          flush=True)
    return result


def _engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    flags = {k: getattr(args, k) for k in ("max_total_tokens", "max_running_requests",
                                           "chunked_prefill_size", "max_prefill_tokens",
                                           "page_size", "dtype")
             if getattr(args, k) is not None}
    if args.quick:  # a small pool: the default one (GiBs) takes longer to allocate than to use
        flags.setdefault("max_total_tokens", QUICK_POOL_TOKENS)
    return flags


def _header(args: argparse.Namespace, path: Path, requests: list, machine: Machine) -> str:
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    return (f"workload {Path(args.workload).name}{' (quick)' if args.quick else ''}: "
            f"{len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
            f"(greedy, EOS ignored); model {path.name}, float32, "
            f"{torch.get_num_threads()} torch threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
            f"\nmachine: float32 matmul {machine.flops_per_s / 1e9:.0f} GFLOP/s (torch/MKL), "
            + (f"{machine.onednn_flops_per_s / 1e9:.0f} GFLOP/s (oneDNN), "
               if machine.onednn_flops_per_s else "")
            + f"memory {machine.bytes_per_s / 1e9:.0f} GB/s")


def _run_ours(args: argparse.Namespace, requests: list, modes: list[str],
              engine_flags: dict[str, Any]
              ) -> tuple[list[Result], DecodeTiming | None, dict[str, list[list[int]]]]:
    """Each batching mode in-process, then the stack if asked; the decode steps to time."""
    results: list[Result] = []
    timing: DecodeTiming | None = None
    ours: dict[str, list[list[int]]] = {}
    for mode in modes:
        result, t, tokens = run_tokenline(args.model, requests, mode, engine_flags, args.progress)
        results.append(_printed(result))
        ours[mode] = tokens
        if mode == "continuous" or timing is None:  # the continuous run's steps if there is one
            timing = t
    if args.json_schema:
        schema = TYPICAL_SCHEMA if args.json_schema == "typical" else json.loads(
            Path(args.json_schema).read_text())
        result, t, _ = run_tokenline(args.model, requests, "continuous", engine_flags,
                                     args.progress, schema)
        if t.mask_seconds:
            result.extra.update(mask_batch=t.batch, mask_steps=len(t.mask_seconds),
                                mask_ms_median=1000 * statistics.median(t.mask_seconds))
        results.append(_printed(result))
    if args.with_stack:
        stack_flags = {**engine_flags, **({"num_threads": args.threads} if args.threads else {})}
        results.append(_printed(run_stack(args.model, requests, stack_flags)))
    return results, timing, ours


def _run_hf(args: argparse.Namespace, path: Path, requests: list, hf_sizes: list[int],
            ours: dict[str, list[list[int]]]) -> tuple[list[Result], dict[str, Any]]:
    """transformers at each static batch size and continuous; agreement at batch 1."""
    results: list[Result] = []
    agreement: dict[str, Any] = {}
    model = load_hf_model(path)
    for size in hf_sizes:
        result, tokens = run_hf_static(model, requests, size, args.progress)
        results.append(result)
        if size == 1 and ours:
            mine = ours.get("continuous") or next(iter(ours.values()))
            same = sum(a == b for a, b in zip(mine, tokens, strict=True))
            agreement = {"requests": len(requests), "identical": same}
            result.extra["identical_to_tokenline"] = same
        _printed(result)
    if not args.no_hf_continuous:
        result, _ = run_hf_continuous(model, requests, args.hf_max_batch_tokens, args.progress)
        results.append(_printed(result))
    del model
    gc.collect()
    return results, agreement


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = _csv(args.batching)
    for m in modes:
        if m not in BATCHING_MODES:
            parser.error(f"--batching: {m!r} is not one of {', '.join(BATCHING_MODES)}")
    try:
        hf_sizes = [int(b) for b in _csv(args.hf_batch_sizes)]
    except ValueError:
        parser.error("--hf-batch-sizes: comma-separated integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    from common.modelstore import prepare_model

    path = prepare_model(args.model)
    config = json.loads((path / "config.json").read_text())
    requests = load_workload(args.workload, args.num_prompts, path / "tokenizer.json", args.quick)
    if not requests:
        parser.error(f"{args.workload}: no requests")
    engine_flags = _engine_flags(args)
    machine = measure(args.quick)
    header = _header(args, path, requests, machine)
    print(header, flush=True)
    results, timing, ours = _run_ours(args, requests, modes, engine_flags)
    agreement: dict[str, Any] = {}
    if hf_sizes or not args.no_hf_continuous:
        hf_results, agreement = _run_hf(args, path, requests, hf_sizes, ours)
        results += hf_results
    if timing and timing.seconds:
        # again at the end: a peak only drops when something else wants the cores, so the
        # better of the two is the closer to what the machine can do
        again = measure(args.quick)
        machine = Machine(max(machine.flops_per_s, again.flops_per_s),
                          max(machine.bytes_per_s, again.bytes_per_s),
                          max(machine.onednn_flops_per_s or 0, again.onednn_flops_per_s or 0)
                          or None)
    roof = roofline(timing, config, machine) if timing else None
    _report(args, path, requests, results, roof, header, engine_flags, agreement, machine)
    return 0


def _report(args: argparse.Namespace, path: Path, requests: list, results: list[Result],
            roof: dict | None, header: str, engine_flags: dict[str, Any],
            agreement: dict[str, Any], machine: Machine) -> None:
    print()
    print(format_report(results, roof, header))
    if roof and engine_flags.get("dtype") not in (None, "auto", "float32"):
        print(f"note: the roofline bound is float32's (its matmul peak, 4-byte weights); under "
              f"--dtype {engine_flags['dtype']} our projections run faster than that peak, so "
              "the fraction above overstates how close to this machine's limit they are")
    if agreement:
        print(f"greedy tokens identical to transformers generate (batch 1): "
              f"{agreement['identical']}/{agreement['requests']} requests")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "workload": str(args.workload), "quick": args.quick, "model": str(path),
            "num_requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
            "threads": torch.get_num_threads(), "machine": asdict(machine),
            "results": [r.to_json() for r in results], "roofline": roof,
            "greedy_agreement": agreement or None,
        }, indent=1))

if __name__ == "__main__":
    sys.exit(main())
