"""common.tracing and the scheduler's spans, without a stack: off costs nothing, the endpoint
rules, OTLP/gRPC export, and the span tree the scheduler builds from engine steps."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.otlp_receiver import GrpcOtlpReceiver
from common import tracing
from common.config import ServerArgs
from common.messages import Finish, SamplingParams, TokenizedReq, TokenOut
from services.scheduler.core.engine import StepStats
from services.scheduler.spans import SchedulerSpans
from tests.helpers import REPO

PARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def test_tracing_off_never_loads_opentelemetry():
    code = (
        "import sys\n"
        "from common import tracing\n"
        "from common.config import ServerArgs\n"
        "import services.gateway.server, services.scheduler.server\n"
        "import services.tokenizer.server, services.detokenizer.server\n"
        "assert not tracing.setup('scheduler', ServerArgs())\n"
        "assert not tracing.enabled()\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_endpoint_flag_env_and_protocol_rules(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    assert tracing.resolve_endpoint(ServerArgs()) is None
    args = ServerArgs(otlp_traces_endpoint="http://collector:4318/v1/traces")
    assert tracing.resolve_endpoint(args) == ("http://collector:4318/v1/traces", "http/protobuf")
    args = ServerArgs(otlp_traces_endpoint="grpc://collector:4317")
    assert tracing.resolve_endpoint(args) == ("grpc://collector:4317", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert tracing.resolve_endpoint(ServerArgs()) == ("collector:4317", "grpc")
    # an explicit flag wins over the environment
    args = ServerArgs(otlp_traces_endpoint="http://other:4318")
    assert tracing.resolve_endpoint(args)[0] == "http://other:4318"


def test_http_exporter_adds_the_traces_path_to_a_base_url():
    assert tracing.make_exporter("http://c:4318", "http/protobuf")._endpoint \
        == "http://c:4318/v1/traces"
    assert tracing.make_exporter("http://c:4318/v1/traces", "http/protobuf")._endpoint \
        == "http://c:4318/v1/traces"


def test_grpc_exporter_delivers_spans_to_an_otlp_receiver():
    receiver = GrpcOtlpReceiver().start()
    try:
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(tracing.make_exporter(receiver.endpoint, "grpc")))
        with provider.get_tracer("t").start_as_current_span("over-grpc"):
            pass
        provider.shutdown()
        assert [s.name for s in receiver.spans] == ["over-grpc"]
    finally:
        receiver.stop()


def test_traceparent_helpers_round_trip():
    assert tracing.trace_id(PARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.trace_id({}) is None and tracing.trace_id({"traceparent": "junk"}) is None
    assert tracing.item_header(3) == "tl-tp-3"


@pytest.fixture
def exported(monkeypatch):
    """A tracer whose spans land in memory, as if `setup` had installed one."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter


def _req(rid: str, prompt: int) -> TokenizedReq:
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=list(range(prompt)),
                        params=SamplingParams(max_new_tokens=3, temperature=0.5))


def _out(rid: str, tokens: list[int], done: int, finish: Finish | None = None,
         retractions: int = 0) -> TokenOut:
    return TokenOut(rid=rid, gateway_id="g", token_ids=tokens, finish=finish, prompt_tokens=20,
                    completion_tokens=done, retractions=retractions)


def test_scheduler_spans_follow_chunks_retraction_and_finish(exported):
    spans = SchedulerSpans()
    spans.arrive(_req("a", 20), PARENT)
    spans.arrive(_req("untraced", 5), {})  # no context came with it: no spans
    assert len(spans) == 1
    later = time.time_ns() + 1_000_000  # steps after the arrival, a microsecond apart
    ns = iter(range(later, later + 100_000, 1_000))

    def step(outputs, **kw) -> None:
        spans.after_step(outputs, StepStats(**kw), next(ns), next(ns))

    step([], scheduled_rids=["a"], num_new=[16])  # first chunk
    step([_out("a", [7], 1)], scheduled_rids=["a"], num_new=[4])  # last chunk, first token
    step([_out("a", [8], 2)], scheduled_rids=["a"], num_new=[1])  # decode
    step([], retracted_rids=["a"])  # pool full: back to waiting
    step([_out("a", [9], 3, Finish(kind="length"), 1)], scheduled_rids=["a"], num_new=[22])
    assert len(spans) == 0

    done = {s.name: s for s in exported.get_finished_spans()}
    got = exported.get_finished_spans()
    assert sorted(s.name for s in got) == ["decode", "generate", "prefill", "prefill",
                                           "prefill", "queued", "queued"]
    gen, decode = done["generate"], done["decode"]
    assert gen.parent.span_id == 0x00f067aa0ba902b7
    assert all(s.parent.span_id == gen.context.span_id for s in got if s is not gen)
    chunks = sorted((s for s in got if s.name == "prefill"), key=lambda s: s.start_time)
    assert [c.attributes["tokenline.prefill.tokens"] for c in chunks] == [16, 4, 22]
    assert [c.attributes["tokenline.recompute"] for c in chunks] == [False, False, True]
    assert [e.name for e in decode.events] == ["retraction"]
    assert decode.start_time == chunks[1].end_time and decode.end_time == gen.end_time
    assert gen.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert gen.attributes["gen_ai.request.temperature"] == 0.5
    assert gen.attributes["tokenline.retractions"] == 1


def test_scheduler_spans_of_a_request_aborted_while_queued_say_abort(exported):
    spans = SchedulerSpans()
    spans.arrive(_req("a", 4), PARENT)
    spans.after_step([_out("a", [], 0, Finish(kind="abort", message="aborted by client"))],
                     StepStats(), time.time_ns(), time.time_ns())
    got = {s.name: s for s in exported.get_finished_spans()}
    assert set(got) == {"generate", "queued"}
    gen = got["generate"]
    assert gen.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert gen.status.status_code.name == "ERROR"
    assert gen.status.description == "aborted by client"


def test_scheduler_span_names_the_lora_adapter(exported):
    spans = SchedulerSpans()
    req = _req("a", 4)
    req.lora_name = "pirate"
    spans.arrive(req, PARENT)
    spans.arrive(_req("b", 4), PARENT)
    spans.after_step([_out(r, [1], 1, Finish(kind="length")) for r in ("a", "b")],
                     StepStats(scheduled_rids=["a", "b"], num_new=[4, 4]), time.time_ns(),
                     time.time_ns())
    gens = {s.attributes["tokenline.rid"]: s for s in exported.get_finished_spans()
            if s.name == "generate"}
    assert gens["a"].attributes["tokenline.lora_name"] == "pirate"
    assert "tokenline.lora_name" not in gens["b"].attributes  # the base
