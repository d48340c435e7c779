"""The load generator measured against a fake OpenAI server that records its own timing.

The fake streams the first token 50 ms after the request and one every 10 ms after that
(on absolute deadlines, so sleeps that overrun do not add up), `max_tokens` tokens in all,
and notes when it got each request and when it sent each token, on the clock the client
uses (same process). The client's latencies are checked against those notes: never less than
what the server did (exact), never much more (a generous bound, for a loaded machine).
A prompt starting with "slow" gets its first token after 1 s; "fail" gets HTTP 400;
"midfail" gets an error event after two tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from bench import serve
from bench.datasets import (
    SampleRequest,
    load_conversations,
    load_jsonl,
    load_sharegpt,
    random_requests,
)
from bench.serve import run_benchmark
from bench.stats import (
    RequestOutput,
    arrival_times,
    compute_metrics,
    meets_slos,
    parse_goodput,
    percentile,
)

FIRST_S = 0.050
GAP_S = 0.010
SLOW_FIRST_S = 1.0
# How much later than the server's own timestamps the client may see a token: loopback and a
# busy event loop, on a shared machine. Orderings against the timestamps are exact.
SLACK_S = 0.5


class FakeServer:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        # prompt -> (when the request came in, when each content token went out)
        self.timeline: dict[str, tuple[float, list[float]]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await request.json()
        self.bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        tag = prompt if isinstance(prompt, str) else ""
        if tag.startswith("fail"):
            return web.json_response(
                {"error": {"message": "prompt refused", "type": "invalid_request_error",
                           "param": "prompt", "code": None}}, status=400)
        n = body["max_tokens"]
        first = SLOW_FIRST_S if tag.startswith("slow") else FIRST_S
        sent: list[float] = []
        self.timeline[tag] = (t0, sent)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if chat:  # OpenAI opens a chat stream with an empty role-only delta
                await self._send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                delay = t0 + first + i * GAP_S - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if tag.startswith("midfail") and i == 2:
                    await resp.write(b"event: error\n")
                    await self._send(resp, {"error": {"message": "engine died", "code": 500}})
                    return resp
                text = f" t{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {
                    "index": 0, "text": text}
                sent.append(time.perf_counter())  # before the write: no reader can be earlier
                await self._send(resp, {"choices": [choice]})
            if not chat:  # chat gets no usage, so the client must count chunks
                await self._send(resp, {"choices": [], "usage": {
                    "prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                    "prompt_tokens_details": {"cached_tokens": 3}}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1

    @staticmethod
    async def _send(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake():
    server = FakeServer()
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


def _reqs(n: int, max_tokens: int, prompt: str = "hello") -> list[SampleRequest]:
    return [SampleRequest(prompt=prompt, prompt_len=1, max_tokens=max_tokens) for _ in range(n)]


def assert_times_match_the_server(ttft: float, itl: list[float], e2el: float,
                                  timeline: tuple[float, list[float]]) -> None:
    """The client's view of one request against the server's notes. The client started its
    clock before the server got the request and read each token after it was sent, so every
    client time is at least the server's; and at most SLACK_S more."""
    received, sent = timeline
    assert len(itl) == len(sent) - 1
    seen = np.cumsum([ttft, *itl])  # when the client saw token k, from its own start
    for k, t in enumerate(seen):
        assert t >= sent[k] - received, (k, t, sent[k] - received)
        assert t - (sent[k] - received) < SLACK_S, (k, t, sent[k] - received)
    assert e2el >= seen[-1] >= sent[-1] - received


async def test_latencies_match_the_servers_own_timestamps(fake: FakeServer) -> None:
    n_tokens = 12
    reqs = [SampleRequest(prompt=f"hello {i}", prompt_len=1, max_tokens=n_tokens)
            for i in range(4)]
    result = await run_benchmark(fake.url, reqs, max_concurrency=4)
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["model"] == "fake-model"  # taken from /v1/models
    assert result["output_lens"] == [n_tokens] * 4
    assert result["total_output_tokens"] == 4 * n_tokens
    assert result["input_lens"] == [7] * 4  # the server's usage beats the estimate
    for req, ttft, e2el, itl, tpot in zip(
        reqs, result["ttfts"], result["e2els"], result["itls"], result["tpots"], strict=True
    ):
        assert_times_match_the_server(ttft, itl, e2el, fake.timeline[req.prompt])
        assert tpot == pytest.approx((e2el - ttft) / (n_tokens - 1))
    assert result["mean_ttft_ms"] == pytest.approx(np.mean(result["ttfts"]) * 1000)
    itls_ms = np.concatenate(result["itls"]) * 1000
    assert result["median_itl_ms"] == pytest.approx(np.median(itls_ms))
    assert result["generated_texts"][0] == "".join(f" t{i}" for i in range(n_tokens))
    body = fake.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and "ignore_eos" not in body


async def test_chat_endpoint_without_usage_counts_content_chunks(fake: FakeServer) -> None:
    reqs = _reqs(1, 6, prompt="chat a") + _reqs(1, 6, prompt="chat b")
    result = await run_benchmark(
        fake.url, reqs, endpoint="/v1/chat/completions", model="m", ignore_eos=True
    )
    assert result["completed"] == 2
    assert result["output_lens"] == [6, 6]
    # The empty role-only delta (sent at once) is not the first token: the content 50 ms on is.
    for req, ttft, itl, e2el in zip(reqs, result["ttfts"], result["itls"], result["e2els"],
                                    strict=True):
        assert_times_match_the_server(ttft, itl, e2el, fake.timeline[req.prompt])
    body = fake.bodies[-1]
    assert body["messages"] in [[{"role": "user", "content": r.prompt}] for r in reqs]
    assert body["ignore_eos"] is True and body["model"] == "m"


async def test_chat_endpoint_refuses_token_id_prompts(fake: FakeServer) -> None:
    with pytest.raises(ValueError, match="text prompts"):
        await run_benchmark(
            fake.url, [SampleRequest([1, 2], 2, 4)], endpoint="/v1/chat/completions"
        )


async def test_token_id_prompts_are_sent_as_a_list(fake: FakeServer) -> None:
    await run_benchmark(fake.url, [SampleRequest([5, 6, 7], 3, 2)], model="m")
    assert fake.bodies[-1]["prompt"] == [5, 6, 7]


async def test_conversation_turns_go_in_order_and_cached_tokens_are_counted(fake) -> None:
    fake.max_in_flight = 0
    start = len(fake.bodies)
    requests = [SampleRequest([c, t], 2, 3, conversation=c) for c in (0, 1) for t in range(3)]
    result = await run_benchmark(fake.url, requests, model="m")
    assert result["completed"] == 6
    sent = [b["prompt"] for b in fake.bodies[start:]]
    for c in (0, 1):  # each conversation's turns in order, one at a time
        assert [p for p in sent if p[0] == c] == [[c, 0], [c, 1], [c, 2]]
    assert fake.max_in_flight == 2
    assert result["total_cached_tokens"] == 6 * 3 and result["cached_lens"] == [3] * 6
    assert result["cache_hit_rate"] == pytest.approx(3 / 7)
    assert "Prefix cache hit rate:" in serve.format_result(result)


def test_the_multiturn_workload_re_sends_each_conversations_history() -> None:
    path = Path(__file__).resolve().parents[2] / "bench" / "workloads" / "multiturn32x6.jsonl"
    reqs = load_conversations(path)
    assert len(reqs) == 32 * 6 and len({r.conversation for r in reqs}) == 32
    system = reqs[0].prompt[:1024]
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert b.prompt[:1024] == system
        if a.conversation == b.conversation:  # the previous prompt, its answer, a new message
            assert b.prompt[:len(a.prompt)] == a.prompt
            assert len(b.prompt) >= len(a.prompt) + a.max_tokens + 24
    assert len(load_conversations(path, 2)) == 12


async def test_goodput_counts_only_requests_meeting_every_slo(fake: FakeServer) -> None:
    # fast: TTFT 50 ms, TPOT 10 ms; slow: TTFT >= 1 s. The SLOs sit far from both.
    requests = _reqs(3, 8) + _reqs(2, 8, prompt="slow please")
    result = await run_benchmark(
        fake.url, requests, model="m", goodput={"ttft": 500.0, "tpot": 200.0}
    )
    assert result["completed"] == 5
    assert result["good_requests"] == 3
    assert result["request_goodput"] == pytest.approx(3 / result["duration"])
    # A loose SLO admits all; one below the server's own 120 ms of sending admits none.
    loose = await run_benchmark(fake.url, requests, model="m", goodput={"e2el": 60000.0})
    assert loose["good_requests"] == 5
    strict = await run_benchmark(fake.url, requests, model="m", goodput={"e2el": 100.0})
    assert strict["good_requests"] == 0


async def test_failed_requests_are_counted_with_their_error(fake: FakeServer) -> None:
    requests = _reqs(2, 4) + _reqs(1, 4, prompt="fail now") + _reqs(1, 6, prompt="midfail")
    result = await run_benchmark(fake.url, requests, model="m", max_concurrency=1)
    assert result["completed"] == 2 and result["failed"] == 2
    assert result["first_error"] == "HTTP 400: prompt refused"
    assert result["errors"][3] == "stream error: engine died"
    assert result["total_output_tokens"] == 8  # failed requests add no tokens


async def test_unreachable_server_fails_requests_not_the_run() -> None:
    result = await run_benchmark("http://127.0.0.1:9", _reqs(2, 4), model="m")
    assert result["failed"] == 2 and result["first_error"]


async def test_max_concurrency_is_respected(fake: FakeServer) -> None:
    fake.max_in_flight = 0
    result = await run_benchmark(fake.url, _reqs(9, 3), model="m", max_concurrency=3)
    assert result["completed"] == 9
    assert fake.max_in_flight == 3


async def test_request_rate_spaces_the_sends(fake: FakeServer) -> None:
    rate, n = 40.0, 8
    result = await run_benchmark(fake.url, _reqs(n, 2), request_rate=rate, model="m", seed=3)
    expected = arrival_times(n, rate, 1.0, seed=3)
    late = np.asarray(result["start_times"]) - expected
    # never early (but for the clock's resolution), never far behind
    assert (late > -1e-6).all() and (late < SLACK_S).all(), late


def test_percentiles_agree_with_numpy() -> None:
    rng = np.random.default_rng(1)
    values = rng.exponential(3.0, size=101)
    for p in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values.tolist(), p) == pytest.approx(np.percentile(values, p))
    assert percentile([], 99) == 0.0
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_compute_metrics_on_fixed_outputs() -> None:
    outs = [
        RequestOutput(success=True, prompt_len=10, output_tokens=5, ttft=0.1, e2el=0.5,
                      itl=[0.1] * 4),
        RequestOutput(success=True, prompt_len=20, output_tokens=1, ttft=0.3, e2el=0.3),
        RequestOutput(success=False, error="boom", prompt_len=99),
    ]
    m = compute_metrics(outs, 2.0, percentiles=[50, 90], goodput_slos_ms={"ttft": 200})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 18.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(np.percentile([100, 300], 90))
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # the one-token request has no TPOT
    assert m["p99_itl_ms"] == pytest.approx(100.0)  # p99 is always there, for the plot
    assert m["good_requests"] == 1 and m["request_goodput"] == 0.5


def test_goodput_slo_parsing_and_checks() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50", "e2el:1e3"]) == {
        "ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    out = RequestOutput(success=True, output_tokens=3, ttft=0.1, e2el=0.3)  # tpot 100 ms
    assert meets_slos(out, {"ttft": 100, "tpot": 100, "e2el": 300})
    assert not meets_slos(out, {"tpot": 99})
    assert meets_slos(RequestOutput(success=True, output_tokens=1, ttft=0.1, e2el=0.1),
                      {"tpot": 1})  # one token: no decode, TPOT 0


def test_poisson_arrivals_have_the_asked_mean_and_cv_one() -> None:
    rate = 8.0
    gaps = np.diff(arrival_times(200_001, rate, burstiness=1.0, seed=0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("k", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(k: float) -> None:
    rate = 5.0
    gaps = np.diff(arrival_times(200_001, rate, burstiness=k, seed=1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(k), rel=0.04)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5


def test_datasets(tmp_path) -> None:
    reqs = random_requests(50, 100, 20, range_ratio=0.5, vocab_size=2000, seed=0)
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.max_tokens <= 30 for r in reqs)
    assert all(1000 <= t < 2000 for r in reqs for t in r.prompt)
    assert [r.prompt for r in random_requests(3, 8, 4, seed=5)] == [
        r.prompt for r in random_requests(3, 8, 4, seed=5)]

    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('# a comment\n{"prompt": "a b c", "max_tokens": 3}\n\n'
                     '{"prompt_token_ids": [1, 2], "max_tokens": 9}\n')
    a, b = load_jsonl(jsonl)
    assert (a.prompt, a.max_tokens) == ("a b c", 3)
    assert (b.prompt, b.prompt_len, b.max_tokens) == ([1, 2], 2, 9)

    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi there"},
                           {"from": "gpt", "value": " ".join(["w"] * 100)}]},
        {"conversations": [{"from": "gpt", "value": "skipped: no human opening"}]},
    ]))
    (only,) = load_sharegpt(sharegpt)
    assert (only.prompt, only.max_tokens) == ("hi there", 130)
    assert load_sharegpt(sharegpt, output_len=50)[0].max_tokens == 50


@contextlib.contextmanager
def _fake_server_in_thread() -> Iterator[str]:
    """The CLI runs its own event loop (asyncio.run), so its server needs another thread."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(FakeServer().app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_cli_sweep_writes_json_and_png(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "sweep.png"
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "x", "max_tokens": 4}) for _ in range(6)))
    with _fake_server_in_thread() as url:
        rc = serve.main([
            "--base-url", url, "--dataset-name", "jsonl", "--dataset-path", str(data),
            "--request-rate", "50,inf", "--percentiles", "50,90,99",
            "--goodput", "ttft:1000", "--result-json", str(out_json), "--plot", str(out_png),
            "--disable-tqdm",
        ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P90 TTFT (ms):" in printed
    assert "Request goodput (req/s):" in printed
    doc = json.loads(out_json.read_text())
    assert [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
    assert doc["runs"][1]["completed"] == 6 and len(doc["runs"][1]["itls"]) == 6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_committed_workloads_hold_what_they_say() -> None:
    root = Path(__file__).resolve().parents[2] / "bench" / "workloads"
    mixed = load_jsonl(root / "mixed64.jsonl")
    assert len(mixed) == 64
    assert all(32 <= r.prompt_len <= 512 and 16 <= r.max_tokens <= 256 for r in mixed)
    assert all(1000 <= t < 40000 for r in mixed for t in r.prompt)
    assert (sum(r.prompt_len for r in mixed), sum(r.max_tokens for r in mixed)) == (18685, 7729)
    shared = load_jsonl(root / "shared_prefix32.jsonl")
    assert len(shared) == 32 and all(r.max_tokens == 16 for r in shared)
    prefix = shared[0].prompt[:1500]
    assert all(r.prompt[:1500] == prefix and 8 <= r.prompt_len - 1500 <= 24 for r in shared)
    assert len({tuple(r.prompt[1500:]) for r in shared}) == 32  # the questions differ
    assert sum(r.prompt_len for r in shared) == 48507
