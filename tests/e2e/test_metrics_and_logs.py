"""/metrics and the log lines after a scripted run: 3 requests completed (one of them retracted
once and resumed), 1 aborted and 1 refused by the tokenizer. Counters and histogram counts move
by exactly that, and every query of the provisioned Grafana dashboard finds its series."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests import dashboard
from tests.helpers import Stack, metric

# 16 KV blocks of 16 tokens. Two requests of 16 prompt + 144 output tokens are admitted
# together and collide late: exactly one is retracted, once, and resumes after the other ends.
FLAGS = ("--max-total-tokens", "256", "--page-size", "16", "--stats-interval", "0.2",
         "--log-stats-interval", "2")
TRACE_IDS = ["0af7651916cd43dd8448eb211c80319c", "1bf7651916cd43dd8448eb211c80319d",
             "2cf7651916cd43dd8448eb211c80319e"]
HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds",
              "request_queue_time_seconds")


def _traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}


async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def _settled(http: aiohttp.ClientSession, url: str, generated: int) -> str:
    """/metrics once no stage holds a request and the heartbeats carry the last tokens."""
    deadline = time.monotonic() + 30
    while True:
        text = await _metrics(http, url)
        idle = not any(metric(text, "tokenline:requests_in_flight", service=s)
                       for s in ("gateway", "tokenizer", "scheduler", "detokenizer"))
        if idle and metric(text, "tokenline:generation_tokens_total") >= generated:
            await asyncio.sleep(0.5)  # one more heartbeat: nothing moves any more
            return await _metrics(http, url)
        assert time.monotonic() < deadline, "the stack did not settle"
        await asyncio.sleep(0.2)


async def _complete(http, url: str, body: dict, headers: dict | None = None) -> dict:
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _stream_and_abort(http, url: str, body: dict) -> tuple[str, list[str], dict]:
    """Stream, abort by rid after the first text, read to the end: (rid, reasons, usage)."""
    reasons: list[str] = []
    usage: dict = {}
    rid = None
    async with http.post(url + "/v1/completions", json=body,
                         headers=_traceparent(TRACE_IDS[2])) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                reasons.append(choice["finish_reason"])
                if rid is None and choice["text"]:
                    rid = chunk["id"]
                    async with http.post(url + "/abort_request", json={"rid": rid}) as a:
                        assert a.status == 200
    assert rid is not None
    return rid, reasons, usage


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run():
    """The scripted run, once: /metrics before and after, the responses, the stack's logs."""
    stack = await asyncio.get_running_loop().run_in_executor(None, Stack(*FLAGS).start)
    try:
        # a hang guard only: on a loaded shared machine the pair below takes minutes
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=420)) as http:
            before = await _metrics(http, stack.url)
            done = [await _complete(http, stack.url, {"prompt": "Hello, my name is",
                                                      "max_tokens": 8, "temperature": 0})]
            pair = [
                _complete(http, stack.url, {"prompt": list(range(t, t + 16)), "max_tokens": 144,
                                            "ignore_eos": True, "temperature": 0},
                          _traceparent(trace_id))
                for t, trace_id in ((1000, TRACE_IDS[0]), (3000, TRACE_IDS[1]))
            ]
            done += await asyncio.gather(*pair)
            aborted = await _stream_and_abort(http, stack.url, {
                "prompt": "Count to a thousand:", "max_tokens": 144, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})
            # accepted by the gateway, refused by the tokenizer: an error, not an abort
            async with http.post(stack.url + "/v1/completions",
                                 json={"prompt": "Hello", "max_tokens": 10**7}) as r:
                assert r.status == 400 and "maximum context length" in await r.text()
            generated = metric(before, "tokenline:generation_tokens_total") + sum(
                o["usage"]["completion_tokens"] for o in done) + aborted[2]["completion_tokens"]
            after = await _settled(http, stack.url, generated)
        await _stats_line_after_the_retraction(stack)
    finally:
        stack.stop()
    return {"before": before, "after": after, "done": done, "aborted": aborted,
            "logs": stack.logs()}


async def _stats_line_after_the_retraction(stack: Stack, timeout: float = 30) -> None:
    """Wait until the scheduler has logged a stats line after its retraction, then return.

    A stats line closes a window of at least --log-stats-interval (2 s here): a busy line when
    a step ends one, else the line that closes it up to a second after the scheduler goes
    idle. A fast machine finishes everything after the retraction inside one window, so that
    line may come after /metrics has settled; stopping the stack then would lose it. (No line
    after a retraction means no retraction: the tests below say so.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [json.loads(raw) for raw in stack.logs().splitlines() if raw.startswith("{")]
        events = [line["event"] for line in lines if line.get("service") == "scheduler"]
        if "request retracted" in events and \
                "stats" in events[events.index("request retracted"):]:
            return
        await asyncio.sleep(0.3)


def _delta(run: dict, name: str, **labels) -> float:
    return metric(run["after"], name, **labels) - metric(run["before"], name, **labels)


def test_metrics_parse_and_every_series_names_the_model(run):
    families = list(text_string_to_metric_families(run["after"]))
    ours = [f for f in families if f.name.startswith("tokenline:")]
    assert {f.name for f in ours} >= {
        "tokenline:num_requests_running", "tokenline:num_requests_waiting",
        "tokenline:kv_cache_usage_perc", "tokenline:num_retractions",
        "tokenline:num_requests_aborted", "tokenline:time_to_first_token_seconds",
        "tokenline:inter_token_latency_seconds", "tokenline:e2e_request_latency_seconds",
        "tokenline:request_queue_time_seconds", "tokenline:prompt_tokens",
        "tokenline:generation_tokens", "tokenline:prefix_cache_queries",
        "tokenline:prefix_cache_hits", "tokenline:requests_in_flight",
        "tokenline:request_success",
    }
    model = run["done"][0]["model"]
    for fam in ours:
        for sample in fam.samples:
            assert sample.labels.get("model_name") == model, sample


def test_counters_move_by_exactly_the_scripted_run(run):
    done, (_, reasons, abort_usage) = run["done"], run["aborted"]
    assert "abort" in reasons
    assert _delta(run, "tokenline:num_retractions_total") == 1
    assert _delta(run, "tokenline:num_requests_aborted_total") == 1
    assert _delta(run, "tokenline:prompt_tokens_total") == sum(
        o["usage"]["prompt_tokens"] for o in done) + abort_usage["prompt_tokens"]
    assert _delta(run, "tokenline:generation_tokens_total") == sum(
        o["usage"]["completion_tokens"] for o in done) + abort_usage["completion_tokens"]
    for reason in ("stop", "length"):
        expected = sum(o["choices"][0]["finish_reason"] == reason for o in done)
        assert _delta(run, "tokenline:request_success_total", finished_reason=reason) \
            == expected
    assert _delta(run, "tokenline:request_success_total", finished_reason="abort") == 1
    assert _delta(run, "tokenline:request_success_total", finished_reason="error") == 1


def test_latency_histograms_count_the_completed_requests(run):
    for name in HISTOGRAMS:
        full = f"tokenline:{name}"
        assert _delta(run, full + "_count") == 3, name  # the aborted one is not a latency
        assert _delta(run, full + "_bucket", le="+Inf") == 3, name
        assert _delta(run, full + "_sum") > 0, name
    # one gap per output after the first: at most one per token after the first
    gaps = _delta(run, "tokenline:inter_token_latency_seconds_count")
    assert 0 < gaps <= sum(o["usage"]["completion_tokens"] - 1 for o in run["done"])


def test_gauges_return_to_idle(run):
    after = run["after"]
    assert metric(after, "tokenline:num_requests_running") == 0
    assert metric(after, "tokenline:num_requests_waiting") == 0
    assert metric(after, "tokenline:kv_cache_total_blocks") == 16
    for service in ("gateway", "tokenizer", "scheduler", "detokenizer"):
        assert metric(after, "tokenline:requests_in_flight", service=service) == 0



def test_scheduler_info_names_the_live_schedulers_setup(run):
    (setup,) = [s for fam in text_string_to_metric_families(run["after"])
                if fam.name == "tokenline:scheduler_info" for s in fam.samples]
    assert setup.value == 1 and setup.labels["instance_id"].startswith("scheduler")
    assert setup.labels["quantization"] == "none"  # the stack runs without --quantization
    assert setup.labels["device"] == "cpu" and setup.labels["dtype"] == "float32"

def test_every_dashboard_query_finds_served_series(run):
    """Each selector of each panel (names taken from the parsed PromQL) matches samples that
    /metrics serves, with every label the panel filters or groups by."""
    samples = [s for fam in text_string_to_metric_families(run["after"]) for s in fam.samples]
    model = run["done"][0]["model"]
    checked = set()
    for where, expr in dashboard.expressions(dashboard.load()):
        query = dashboard.parse(expr, model_name=model)
        labels_seen: set[str] = set()
        for name, matchers in query.selectors:
            served = [s for s in samples if s.name == name]
            assert served, f"{where}: /metrics serves no {name}"
            matching = [s for s in served if all(dashboard.matches(m, s.labels)
                                                 for m in matchers)]
            assert matching, f"{where}: no {name} sample matches {matchers}"
            labels_seen.update(label for s in matching for label in s.labels)
            checked.add(name)
        missing = query.grouping - labels_seen
        assert not missing, f"{where}: grouped by {missing}, which its series do not have"
    assert len(checked) >= 12  # the check saw the whole dashboard, not nothing


def _log_lines(run: dict) -> list[dict]:
    lines = []
    for raw in run["logs"].splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))  # not on a terminal: every service line is JSON
    return lines


def test_log_lines_about_a_request_carry_rid_trace_id_and_service(run):
    lines = _log_lines(run)
    assert lines and all("service" in line for line in lines)
    about_requests = [line for line in lines if "rid" in line]
    assert about_requests and all("trace_id" in line for line in about_requests)
    retracted = [line for line in lines if line["event"] == "request retracted"]
    assert len(retracted) == 1
    assert retracted[0]["service"] == "scheduler"
    assert retracted[0]["trace_id"] in TRACE_IDS[:2]  # the client's traceparent, tracing off
    aborted = [line for line in lines if line["event"] == "request aborted"]
    assert [(line["rid"], line["trace_id"]) for line in aborted] \
        == [(run["aborted"][0], TRACE_IDS[2])]


def test_scheduler_logs_stats_lines_while_busy(run):
    stats = [line for line in _log_lines(run) if line["event"] == "stats"]
    assert stats and all(line["service"] == "scheduler" for line in stats)
    for line in stats:
        assert {"running", "queued", "kv_usage_pct", "gen_tokens_per_s", "retractions"} <= \
            set(line)
    assert max(line["retractions"] for line in stats) == 1
    assert max(line["gen_tokens_per_s"] for line in stats) > 0
