"""One OpenTelemetry trace per request across all four services, exported over OTLP/HTTP to a
receiver in this process: parent links, gen_ai.* attributes, aborts, a client's traceparent,
a retraction event, and the flush on shutdown."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.helpers import Stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVICES = {"tokenline-gateway", "tokenline-tokenizer", "tokenline-scheduler",
            "tokenline-detokenizer"}
# A KV pool of 16 blocks: two requests of 16 prompt + 144 output tokens each are admitted
# together and collide late, so exactly one is retracted, once, and resumes when the other is
# done (the scheduler's admission headroom keeps it out until then).
POOL_FLAGS = ("--max-total-tokens", "256", "--page-size", "16")
EXPORT_DELAY = {"OTEL_BSP_SCHEDULE_DELAY": "200"}


async def _start(stack: Stack) -> Stack:
    return await asyncio.get_running_loop().run_in_executor(None, stack.start)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def receiver():
    rec = await OtlpReceiver().start()
    yield rec
    await rec.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(receiver):
    s = await _start(Stack("--otlp-traces-endpoint", receiver.url, *POOL_FLAGS,
                           env=EXPORT_DELAY))
    yield s
    s.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def _trace_of(receiver: OtlpReceiver, rid: str) -> list[ReceivedSpan] | None:
    """The spans of the trace whose gateway span is request `rid`, once every stage has ended
    its part (the HTTP span ends last at the gateway; the detokenizer's may come later)."""
    roots = [s for s in receiver.spans
             if s.kind == "server" and s.attributes.get("tokenline.rid") == rid]
    if not roots:
        return None
    spans = receiver.traces()[roots[0].trace_id]
    names = {s.name for s in spans}
    if not {"tokenize", "generate", "queued", "decode", "detokenize"} <= names:
        return None
    return spans


async def _wait_trace(receiver: OtlpReceiver, rid: str) -> list[ReceivedSpan]:
    spans = await receiver.wait_for(lambda: _trace_of(receiver, rid), timeout=20)
    assert spans, f"no complete trace for {rid}: {[(s.service, s.name) for s in receiver.spans]}"
    await asyncio.sleep(0.5)  # late spans of the same trace (a second prefill chunk, say)
    return _trace_of(receiver, rid) or spans


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}"
    return found[0]


def _check_tree(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    """Parent links: stages under the HTTP span, the scheduler's phases under `generate`."""
    assert {s.service for s in spans} == SERVICES
    assert len({s.trace_id for s in spans}) == 1
    http_span = next(s for s in spans if s.kind == "server")
    assert http_span.service == "tokenline-gateway"
    tok, gen, detok = _one(spans, "tokenize"), _one(spans, "generate"), _one(spans, "detokenize")
    assert tok.service == "tokenline-tokenizer" and tok.parent_span_id == http_span.span_id
    assert gen.service == "tokenline-scheduler" and gen.parent_span_id == http_span.span_id
    assert detok.service == "tokenline-detokenizer" and detok.parent_span_id == gen.span_id
    for s in spans:
        if s.name in ("queued", "prefill", "decode"):
            assert s.service == "tokenline-scheduler" and s.parent_span_id == gen.span_id
        assert s.start_ns <= s.end_ns
    return {"http": http_span, "tokenize": tok, "generate": gen, "detokenize": detok}


async def test_each_request_is_one_trace_across_all_four_services(stack, receiver, http):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.7,
            "top_p": 0.9, "seed": 1}
    async with http.post(stack.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        out = await r.json()
    usage = out["usage"]
    spans = await _wait_trace(receiver, out["id"])
    tree = _check_tree(spans)
    http_span, gen = tree["http"], tree["generate"]
    assert http_span.name == "POST /v1/completions" and http_span.parent_span_id == ""
    expected = {
        "gen_ai.request.max_tokens": 8, "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9, "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": [out["choices"][0]["finish_reason"]],
        "tokenline.rid": out["id"], "tokenline.retractions": 0,
        "tokenline.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }
    for span in (http_span, gen):
        assert {k: span.attributes.get(k) for k in expected} == expected, span.name
        assert span.status == "unset"
    assert http_span.attributes["http.response.status_code"] == 200
    assert tree["tokenize"].attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    # the scheduler's phases in order: queued, then prefill, then decode to the end
    queued, decode = _one(spans, "queued"), _one(spans, "decode")
    prefills = sorted((s for s in spans if s.name == "prefill"), key=lambda s: s.start_ns)
    assert prefills and queued.end_ns <= prefills[0].start_ns
    assert prefills[-1].end_ns <= decode.start_ns and decode.end_ns == gen.end_ns
    assert sum(p.attributes["tokenline.prefill.tokens"] for p in prefills) \
        == usage["prompt_tokens"]
    assert tree["detokenize"].attributes["gen_ai.usage.output_tokens"] \
        == usage["completion_tokens"]


async def test_streamed_chat_request_is_one_trace(stack, receiver, http):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    rid = None
    async with http.post(stack.url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                rid = json.loads(line[6:])["id"]
    spans = await _wait_trace(receiver, rid)
    tree = _check_tree(spans)
    assert tree["http"].name == "POST /v1/chat/completions"
    assert tree["http"].attributes["gen_ai.operation.name"] == "chat"
    assert tree["http"].attributes["gen_ai.request.max_tokens"] == 6


async def test_client_traceparent_is_honoured(stack, receiver, http):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}, "rid": "tp-honoured"}
    async with http.post(stack.url + "/generate", json=body, headers=headers) as r:
        assert r.status == 200
    spans = await _wait_trace(receiver, "tp-honoured")
    tree = _check_tree(spans)
    assert tree["http"].trace_id == trace_id
    assert tree["http"].parent_span_id == parent_id


async def _stream_until_tokens(http, url: str, body: dict):
    """Open a stream and return (response, rid) once the first content arrived."""
    r = await http.post(url + "/v1/completions", json=body)
    assert r.status == 200
    async for line in r.content:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                return r, chunk["id"]
    raise AssertionError("the stream ended before any text")


def _check_aborted(spans: list[ReceivedSpan]) -> None:
    tree = _check_tree(spans)
    for name in ("http", "generate", "detokenize"):
        span = tree[name]
        assert span.attributes["gen_ai.response.finish_reasons"] == ["abort"], name
        assert span.status == "error" and span.attributes.get("error.type") == "abort", name
    assert _one(spans, "decode").attributes["gen_ai.response.finish_reasons"] == ["abort"]


async def test_aborted_request_trace_says_aborted(stack, receiver, http):
    body = {"prompt": "Count: 1 2 3", "max_tokens": 200, "ignore_eos": True, "stream": True}
    r, rid = await _stream_until_tokens(http, stack.url, body)
    async with http.post(stack.url + "/abort_request", json={"rid": rid}) as a:
        assert a.status == 200
    reasons = []
    async for line in r.content:
        if line.startswith(b"data: {"):
            reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
    r.release()
    assert "abort" in reasons
    _check_aborted(await _wait_trace(receiver, rid))


async def test_client_disconnect_trace_says_aborted(stack, receiver, http):
    body = {"prompt": "Count: 4 5 6", "max_tokens": 200, "ignore_eos": True, "stream": True}
    r, rid = await _stream_until_tokens(http, stack.url, body)
    r.close()  # the client goes away mid-stream
    spans = await _wait_trace(receiver, rid)
    _check_aborted(spans)
    http_span = next(s for s in spans if s.kind == "server")
    assert http_span.status_message == "client disconnected"


async def test_retracted_request_trace_has_a_retraction_event(stack, receiver, http):
    async def one(first_token: int) -> dict:
        body = {"prompt": list(range(first_token, first_token + 16)), "max_tokens": 144,
                "ignore_eos": True, "temperature": 0}
        async with http.post(stack.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            return await r.json()

    outs = await asyncio.gather(one(1000), one(3000))
    traces = [await _wait_trace(receiver, o["id"]) for o in outs]
    retracted = [t for t in traces if _one(t, "generate").attributes["tokenline.retractions"]]
    assert len(retracted) == 1, "exactly one of the two should have been retracted"
    spans = retracted[0]
    _check_tree(spans)
    decode = _one(spans, "decode")
    assert [name for name, _ in decode.events] == ["retraction"]
    assert decode.attributes["tokenline.retractions"] == 1
    assert decode.attributes["gen_ai.usage.output_tokens"] == 144
    # it waited again and recomputed its tokens so far before decoding on
    assert len([s for s in spans if s.name == "queued"]) == 2
    assert any(s.attributes["tokenline.recompute"] for s in spans if s.name == "prefill")


async def test_spans_still_buffered_are_exported_at_shutdown(tmp_path):
    """A stack whose exporter would wait a minute: only the flush on shutdown delivers."""
    rec = await OtlpReceiver().start()
    s = await _start(Stack("--otlp-traces-endpoint", rec.url,
                           env={"OTEL_BSP_SCHEDULE_DELAY": "60000"}))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(s.url + "/v1/completions",
                                    json={"prompt": "Hi", "max_tokens": 3}) as r:
                rid = (await r.json())["id"]
        await asyncio.sleep(0.5)
        assert _trace_of(rec, rid) is None, "exported before shutdown: the delay was not used"
    finally:
        await asyncio.get_running_loop().run_in_executor(None, s.stop)
    try:
        spans = _trace_of(rec, rid)
        assert spans is not None, [(x.service, x.name) for x in rec.spans]
        _check_tree(spans)
    finally:
        await rec.stop()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])
