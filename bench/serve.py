"""`tokenline bench serve`: a load generator for any OpenAI-compatible server.

It streams every request, timestamps each content chunk on the client, and reports what
`vllm bench serve` reports (TTFT, TPOT, ITL, E2EL, throughput, goodput), so numbers taken
against tokenline, vLLM or SGLang line up. `run_benchmark` is the same run, in-process.

    tokenline bench serve --base-url http://127.0.0.1:8000 --dataset-name jsonl \\
        --dataset-path bench/workloads/mixed64.jsonl --ignore-eos --request-rate 1,2,4,inf \\
        --result-json out.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from tqdm import tqdm

from bench.datasets import (
    SampleRequest,
    load_conversations,
    load_jsonl,
    load_sharegpt,
    random_requests,
)
from bench.stats import (
    LATENCY_METRICS,
    RequestOutput,
    arrival_times,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    percentile_key,
)

CHAT_ENDPOINT = "/v1/chat/completions"


async def run_benchmark(
    base_url: str,
    requests: list[SampleRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    *,
    endpoint: str = "/v1/completions",
    model: str | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    percentiles: list[float] | tuple[float, ...] = (99,),
    goodput: dict[str, float] | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    request_timeout_s: float = 6 * 3600,
    progress: bool = False,
) -> dict[str, Any]:
    """Send `requests` at `request_rate` (req/s, Gamma arrivals) and return the metrics.

    The result holds the aggregate metrics of `bench.stats.compute_metrics` (latencies in
    ms), the run's settings, `first_error`, and per-request arrays in request order
    (`input_lens`, `cached_lens`, `output_lens`, `ttfts`, `tpots`, `e2els`, `itls`,
    `start_times` in seconds, `errors`, `generated_texts`).
    """
    chat, chains = _is_chat(endpoint, requests), _chains(requests)
    headers = {"Content-Type": "application/json",
               **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    times = arrival_times(len(chains), request_rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc=f"rate {request_rate:g}")
    # Without a connection cap the client, not the server, would queue requests at rate inf.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as session:
        if model is None:
            model = await fetch_first_model(session, base_url, headers)
        drafts_before = await spec_counters(session, base_url, headers)
        outputs, duration = await _send_all(
            session, base_url.rstrip("/") + endpoint, requests, chains, times, semaphore,
            headers, chat, bar,
            lambda req: _request_body(req, model, chat, temperature, ignore_eos, extra_body))
        spec = await _spec_delta(session, base_url, headers, drafts_before)
    bar.close()
    result = compute_metrics(outputs, duration, percentiles, goodput)
    result.update(spec, base_url=base_url, endpoint=endpoint, model=model,
                  num_prompts=len(requests), request_rate=request_rate, burstiness=burstiness,
                  max_concurrency=max_concurrency, **_per_request(outputs))
    return result


def _per_request(outputs: list[RequestOutput]) -> dict[str, Any]:
    """The per-request arrays of a result, in request order, and the first error."""
    errors = [o.error for o in outputs]
    return dict(
        first_error=next((e for e in errors if e), None),
        input_lens=[o.prompt_len for o in outputs],
        cached_lens=[o.cached_tokens for o in outputs],
        output_lens=[o.output_tokens for o in outputs],
        ttfts=[o.ttft for o in outputs],
        tpots=[o.tpot for o in outputs],
        e2els=[o.e2el for o in outputs],
        itls=[o.itl for o in outputs],
        start_times=[o.start for o in outputs],
        errors=errors,
        generated_texts=[o.generated_text for o in outputs],
    )


def _is_chat(endpoint: str, requests: list[SampleRequest]) -> bool:
    chat = endpoint.rstrip("/").endswith("chat/completions")
    if chat and any(isinstance(r.prompt, list) for r in requests):
        raise ValueError(
            f"{endpoint} needs text prompts; send token-id prompts to /v1/completions "
            "(or give --tokenizer to decode them)"
        )
    return chat


def _chains(requests: list[SampleRequest]) -> list[list[int]]:
    """A conversation's turns go one after another; conversations (and plain requests, each
    its own) arrive by the arrival process."""
    chains: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        key = ("request", i) if r.conversation is None else ("conversation", r.conversation)
        chains.setdefault(key, []).append(i)
    return list(chains.values())


async def _send_all(
    session: aiohttp.ClientSession,
    url: str,
    requests: list[SampleRequest],
    chains: list[list[int]],
    times: list[float],
    semaphore: asyncio.Semaphore | None,
    headers: dict[str, str],
    chat: bool,
    bar: tqdm,
    body_of: Callable[[SampleRequest], dict[str, Any]],
) -> tuple[list[RequestOutput], float]:
    """Each chain at its arrival time (seconds from the start); outputs and duration."""
    outputs: list[RequestOutput] = [RequestOutput() for _ in requests]

    async def dispatch(k: int, chain: list[int]) -> None:
        # Absolute send times keep the arrival process exact however long sleeps overrun.
        delay = bench_start + times[k] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for i in chain:
            req = requests[i]
            body = body_of(req)
            async with semaphore or contextlib.nullcontext():
                outputs[i] = await _stream_request(session, url, body, req, headers, chat,
                                                   bench_start)
            bar.update(1)

    bench_start = time.perf_counter()
    await asyncio.gather(*(dispatch(k, chain) for k, chain in enumerate(chains)))
    return outputs, time.perf_counter() - bench_start


SPEC_COUNTERS_SETTLE_S = 1.5
# (draft tokens, accepted tokens) counters of speculative decoding, ours and vLLM's names
SPEC_COUNTERS = (("tokenline:spec_decode_num_draft_tokens_total",
                  "tokenline:spec_decode_num_accepted_tokens_total"),
                 ("vllm:spec_decode_num_draft_tokens_total",
                  "vllm:spec_decode_num_accepted_tokens_total"))


async def _spec_delta(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                      before: tuple[float, float] | None) -> dict[str, Any]:
    """Draft and accepted tokens since `before` (nothing where the server counts none)."""
    if before is None:
        return {}
    # ours reach /metrics with the scheduler's next heartbeat (--stats-interval, 1 s)
    await asyncio.sleep(SPEC_COUNTERS_SETTLE_S)
    after = await spec_counters(session, base_url, headers)
    if after is None:
        return {}
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    return dict(spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
                spec_acceptance_rate=accepted / drafted if drafted else None)


async def spec_counters(session: aiohttp.ClientSession, base_url: str,
                        headers: dict[str, str]) -> tuple[float, float] | None:
    """The server's speculative draft and accepted token counts from /metrics, summed over
    their labels; None where it serves neither (no speculation, or no /metrics)."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name for pair in SPEC_COUNTERS for name in pair}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    for drafted, accepted in SPEC_COUNTERS:
        if drafted in sums and accepted in sums:
            return sums[drafted], sums[accepted]
    return None


async def fetch_first_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {await resp.text()}")
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return models[0]["id"]


def _request_body(
    req: SampleRequest,
    model: str,
    chat: bool,
    temperature: float,
    ignore_eos: bool,
    extra_body: dict[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model or model,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # not OpenAI's, but tokenline, vLLM and SGLang take it
    if extra_body:
        body.update(extra_body)
    return body


async def _stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    req: SampleRequest,
    headers: dict[str, str],
    chat: bool,
    bench_start: float,
) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    t0 = time.perf_counter()
    out.start = t0 - bench_start
    stream = _Stream(out, chat, t0)
    try:
        async with session.post(url, data=msgspec.json.encode(body), headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return out
            if not await stream.read(resp):
                return out
        out.e2el = time.perf_counter() - t0
    except Exception as exc:  # a dropped connection is a failed request, not a crashed run
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    return stream.finish()


class _Stream:
    """One request's SSE stream, read into its RequestOutput as the chunks arrive."""

    def __init__(self, out: RequestOutput, chat: bool, t0: float) -> None:
        self.out = out
        self.chat = chat
        self.t0 = t0
        self.texts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.first_choice_at: float | None = None
        self.last_content_at = 0.0

    async def read(self, resp: aiohttp.ClientResponse) -> bool:
        """Until `[DONE]`; False on an error event (then `out.error` says what)."""
        async for raw in resp.content:
            now = time.perf_counter()  # before parsing, so decode cost is not latency
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, `event:` names, `:` keep-alives
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = msgspec.json.decode(data)
            if msg.get("error"):
                self.out.error = f"stream error: {_error_message(msg)}"
                return False
            if msg.get("usage"):
                self.usage = msg["usage"]
            for choice in msg.get("choices") or []:
                self._choice(choice, now)
        return True

    def _choice(self, choice: dict[str, Any], now: float) -> None:
        if self.first_choice_at is None:
            self.first_choice_at = now
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        if not text:
            return
        if not self.texts:
            self.out.ttft = now - self.t0
        else:
            self.out.itl.append(now - self.last_content_at)
        self.last_content_at = now
        self.texts.append(text)

    def finish(self) -> RequestOutput:
        out, usage = self.out, self.usage
        if self.first_choice_at is None:
            out.error = "stream ended without any choice"
            return out
        if not self.texts:
            # Only empty text came back (e.g. EOS first): the first choice is the first token.
            out.ttft = self.first_choice_at - self.t0
        out.generated_text = "".join(self.texts)
        out.output_tokens = int(usage["completion_tokens"]) if usage else len(self.texts)
        if usage and usage.get("prompt_tokens") is not None:
            out.prompt_len = int(usage["prompt_tokens"])  # the server's count beats our estimate
        if usage:
            out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens") or 0)
        out.success = True
        return out


def _error_message(body: str | dict[str, Any]) -> str:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body.strip()[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def format_result(result: dict[str, Any]) -> str:
    """The result table of `vllm bench serve`, line for line where it has the metric."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt):<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate (req/s):", result["request_rate"], "g")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    if result.get("total_cached_tokens"):
        row("Total cached prompt tokens:", result["total_cached_tokens"])
        row("Prefix cache hit rate:", result["cache_hit_rate"], ".3f")
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    if result.get("spec_draft_tokens"):
        row("Draft tokens (speculative):", result["spec_draft_tokens"], "g")
        row("Draft acceptance rate:", result["spec_acceptance_rate"], ".3f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name, title in LATENCY_METRICS:
        lines.append(f"{title:-^50}")
        upper = name.upper()
        row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {upper} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in result["percentiles"]:
            if p == 50:
                continue  # printed as the median just above
            key = percentile_key(p)
            row(f"{key.upper()} {upper} (ms):", result[f"{key}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot_sweep(results: list[dict[str, Any]], path: str | Path) -> None:
    """Latency percentiles and output throughput against request rate, as one PNG."""
    # Figure + savefig uses the Agg canvas without touching pyplot's global backend.
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    # Rates go on a categorical axis: `inf` has no place on a numeric one.
    xs = list(range(len(results)))
    labels = [f"{r['request_rate']:g}" for r in results]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    lat, thr = fig.subplots(1, 2)
    for metric, marker, color in (("ttft", "o", "tab:blue"), ("tpot", "s", "tab:orange")):
        for stat, line in (("median", "-"), ("p99", "--")):
            ys = [r[f"{stat}_{metric}_ms"] for r in results]
            name = "p50" if stat == "median" else stat
            lat.plot(xs, ys, line, marker=marker, color=color, label=f"{metric.upper()} {name}")
    lat.set_yscale("log")  # TTFT under load is orders of magnitude above TPOT
    lat.yaxis.set_major_formatter(ScalarFormatter())
    lat.yaxis.set_minor_formatter(ScalarFormatter())
    lat.set_ylabel("latency (ms)")
    lat.set_title("Latency vs request rate")
    lat.legend()
    thr.plot(xs, [r["output_throughput"] for r in results], "-o", color="tab:green")
    thr.set_ylabel("output tokens/s")
    thr.set_title("Output throughput vs request rate")
    for ax in (lat, thr):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110)


def _jsonable(value: Any) -> Any:
    # JSON has no infinity; the rate `inf` is written as the string "inf".
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"bad --request-rate {text!r}: positive numbers or inf, comma-separated")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenline bench serve",
        description="Benchmark an OpenAI-compatible server's online serving (vLLM's metrics).",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=["random", "jsonl", "sharegpt", "conversations"],
                   default="random",
                   help="conversations: multi-turn, each turn after the previous answered")
    d.add_argument("--dataset-path", help="file for jsonl, sharegpt and conversations")
    d.add_argument("--num-prompts", type=int,
                   help="requests to send (conversations: how many conversations; default: "
                        "the whole file, or 100 for random)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--tokenizer-vocab-size", type=int, default=49152)
    d.add_argument("--sharegpt-output-len", type=int, help="cap on a ShareGPT request's output")
    d.add_argument("--tokenizer",
                   help="tokenizer path, to decode token-id prompts into text for the chat API")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", default="inf",
                   help="req/s, or a comma-separated sweep such as 1,2,4,inf")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 is Poisson, <1 burstier, >1 steadier")
    t.add_argument("--max-concurrency", type=int)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly max_tokens (sends ignore_eos)")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--extra-body", type=json.loads, help="JSON object merged into each body")
    t.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds")
    o = p.add_argument_group("output")
    o.add_argument("--percentiles", "--metric-percentiles", default="99",
                   help="comma-separated, e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:5000; a request must meet all")
    o.add_argument("--result-json", help="write metrics and per-request arrays here")
    o.add_argument("--plot", help="PNG of latency and throughput against request rate")
    o.add_argument("--disable-tqdm", action="store_true")
    return p


def load_requests(args: argparse.Namespace) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(
            args.num_prompts or 100, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.tokenizer_vocab_size, args.seed,
        )
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "jsonl":
        return load_jsonl(args.dataset_path, args.num_prompts)
    if args.dataset_name == "conversations":
        return load_conversations(args.dataset_path, args.num_prompts)
    return load_sharegpt(args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)


def _decode_prompts(requests: list[SampleRequest], tokenizer_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    for r in requests:
        if isinstance(r.prompt, list):
            r.prompt = tok.decode(r.prompt)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rates = parse_rates(args.request_rate)
        percentiles = parse_percentiles(args.percentiles)
        goodput = parse_goodput(args.goodput)
        requests = load_requests(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if not requests:
        parser.error("the dataset yielded no requests")
    if args.tokenizer and args.endpoint.rstrip("/").endswith("chat/completions"):
        _decode_prompts(requests, args.tokenizer)

    async def sweep() -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        model = args.model
        for rate in rates:
            result = await run_benchmark(
                args.base_url, requests, rate, args.max_concurrency,
                endpoint=args.endpoint, model=model, burstiness=args.burstiness,
                seed=args.seed, percentiles=percentiles, goodput=goodput,
                ignore_eos=args.ignore_eos, temperature=args.temperature,
                extra_body=args.extra_body, api_key=args.api_key,
                request_timeout_s=args.request_timeout,
                progress=not args.disable_tqdm and sys.stderr.isatty(),
            )
            model = result["model"]
            print(format_result(result), flush=True)
            if result["first_error"]:
                print(f"First error: {result['first_error']}", flush=True)
            results.append(result)
        return results

    try:
        results = asyncio.run(sweep())
    except (ValueError, RuntimeError, aiohttp.ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    if len(results) > 1:
        print(format_sweep(results))
    if args.result_json:
        doc = results[0] if len(results) == 1 else {"runs": results}
        Path(args.result_json).write_text(json.dumps(_jsonable(doc), indent=1))
    if args.plot:
        plot_sweep(results, args.plot)
    return 0 if all(r["completed"] > 0 for r in results) else 1


def format_sweep(results: list[dict[str, Any]]) -> str:
    """One line per rate, to read the knee of the curve at a glance."""
    head = (f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'failed':>7}")
    lines = [head]
    for r in results:
        lines.append(
            f"{r['request_rate']:>8g} {r['request_throughput']:>8.2f} "
            f"{r['output_throughput']:>10.1f} {r['median_ttft_ms']:>9.1f} "
            f"{r['p99_ttft_ms']:>9.1f} {r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} "
            f"{r['failed']:>7}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
