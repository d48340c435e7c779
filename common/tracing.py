"""OpenTelemetry for every service: set-up, W3C trace context in NATS headers, span helpers.

Tracing is off unless `--otlp-traces-endpoint` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set.
Off, no tracer provider exists, the SDK is never imported and `enabled()` is False: callers
test it once and skip all span and header work, so the hot paths pay one attribute read.

One request is one trace: the gateway's HTTP span (SERVER) is the root, its context travels
to the tokenizer and the scheduler in the `traceparent` NATS header (never in the payload).
The scheduler sends one message per engine step for many requests, so it records its spans
itself and hands the detokenizer each request's context in a per-item header (`item_header`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from common.messages import Finish, SamplingParams

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from common.config import ServerArgs

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
ITEM_HEADER_PREFIX = "tl-tp-"

# gen_ai.* semantic conventions, and ours
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
OPERATION_NAME = "gen_ai.operation.name"
RESPONSE_ID = "gen_ai.response.id"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
RID = "tokenline.rid"
LORA_NAME = "tokenline.lora_name"  # the LoRA adapter a request runs under (absent: the base)
CACHED_TOKENS = "tokenline.cached_tokens"
RETRACTIONS = "tokenline.retractions"

_tracer: Tracer | None = None
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


# -- set-up -------------------------------------------------------------------------------------
def resolve_endpoint(args: ServerArgs) -> tuple[str, str] | None:
    """(endpoint, protocol) to export to, or None when tracing is off.

    A `grpc://` endpoint means gRPC whatever the protocol flag says; the flag left at its
    default yields to `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`.
    """
    endpoint = args.otlp_traces_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        return None
    protocol = args.otlp_traces_protocol
    env_protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    if protocol == "http/protobuf" and env_protocol in ("grpc", "http/protobuf"):
        protocol = env_protocol
    if urlparse(endpoint).scheme == "grpc":
        protocol = "grpc"
    return endpoint, protocol


def make_exporter(endpoint: str, protocol: str, timeout_s: float = 5.0) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        url = urlparse(endpoint if "://" in endpoint else "grpc://" + endpoint)
        # grpc:// and http:// are plaintext (a local collector); https:// is TLS
        return OTLPSpanExporter(endpoint=url.netloc, insecure=url.scheme != "https",
                                timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = urlparse(endpoint)
    if url.path in ("", "/"):  # a collector's base URL: traces go to its signal path
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)


def setup(service: str, args: ServerArgs, instance_id: str | None = None) -> bool:
    """Install a tracer provider exporting over OTLP if an endpoint is set; True if so."""
    global _tracer, _provider
    target = resolve_endpoint(args)
    if target is None or _tracer is not None:
        return _tracer is not None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"service.name": f"tokenline-{service}"}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attrs))
    # batch size, delay and queue come from OTEL_BSP_* like any OpenTelemetry process
    provider.add_span_processor(BatchSpanProcessor(make_exporter(*target)))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("tokenline")
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered now (a service about to stop: its drain may outlast the
    launcher's grace and end in SIGKILL, and what was flushed first is out by then)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is still buffered (called as a service stops)."""
    global _tracer, _provider
    if _provider is None:
        return
    try:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()
    finally:
        _tracer = _provider = None


# -- context in headers -------------------------------------------------------------------------
_PROPAGATOR: Any = None


def _propagator():
    global _PROPAGATOR
    if _PROPAGATOR is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent a message's (or HTTP request's) headers carry; None without one."""
    if not headers:
        return None
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in carrier:
        return None
    return _propagator().extract(carrier)


def context_from_traceparent(value: str) -> Context:
    return _propagator().extract({TRACEPARENT: value})


def inject(span: Span | None = None) -> dict[str, str]:
    """Headers carrying `span`'s context (default: the current span)."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _propagator().inject(carrier, context=ctx)
    return carrier


def passthrough(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's trace context, forwarded as is (tracing off: logs still carry its trace id)."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in (TRACEPARENT, TRACESTATE)}


def traceparent(span: Span) -> str:
    """W3C traceparent of `span`, formatted directly (cheaper than a propagator per item)."""
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def item_header(index: int) -> str:
    """Header naming the trace parent of item `index` of a batch message.

    Keyed by position, not rid: a rid is a client's string and may not be a valid header name.
    """
    return f"{ITEM_HEADER_PREFIX}{index}"


def trace_id(headers: Mapping[str, str] | None) -> str | None:
    """The trace id in a traceparent header (for log lines), without touching OpenTelemetry."""
    if not headers:
        return None
    tp = headers.get(TRACEPARENT)
    if tp is None or len(tp) < 55:
        return None
    return tp[3:35]


# -- spans --------------------------------------------------------------------------------------
def _kind(kind: str):
    from opentelemetry.trace import SpanKind

    return {"server": SpanKind.SERVER, "consumer": SpanKind.CONSUMER,
            "internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT}[kind]


def start_span(
    name: str,
    parent: Context | Span | str | None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    start_ns: int | None = None,
) -> Span:
    """A span under `parent`: a context, a span, or a traceparent string."""
    from opentelemetry import trace

    assert _tracer is not None, "tracing is off: check enabled() first"
    if isinstance(parent, str):
        parent = context_from_traceparent(parent)
    elif parent is not None and not isinstance(parent, dict):  # a Span (a Context is a dict)
        parent = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=parent, kind=_kind(kind), attributes=attributes,
                              start_time=start_ns)


def use_span(span: Span):
    """Make `span` current for a `with` block (what inject() and logs read)."""
    from opentelemetry import trace

    return trace.use_span(span, end_on_exit=False, record_exception=False,
                          set_status_on_exception=False)


def current_span() -> Span | None:
    if _tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


def request_attributes(params: SamplingParams) -> dict[str, Any]:
    attrs: dict[str, Any] = {REQUEST_TEMPERATURE: params.temperature, REQUEST_TOP_P: params.top_p}
    if params.max_new_tokens is not None:
        attrs[REQUEST_MAX_TOKENS] = params.max_new_tokens
    return attrs


def set_error(span: Span, message: str, error_type: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))


def end_with_finish(
    span: Span,
    finish: Finish | None,
    end_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """End a request's span with how the request ended: finish reason, and an error status
    for an abort or an error (so a trace view flags it)."""
    if attributes:
        span.set_attributes(attributes)
    if finish is not None:
        span.set_attribute(FINISH_REASONS, [finish.kind])
        if finish.kind in ("abort", "error"):
            set_error(span, finish.message or finish.kind, finish.kind)
    span.end(end_time=end_ns)


def usage_attributes(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                     retractions: int) -> dict[str, int]:
    return {USAGE_INPUT_TOKENS: prompt_tokens, USAGE_OUTPUT_TOKENS: completion_tokens,
            CACHED_TOKENS: cached_tokens, RETRACTIONS: retractions}


def now_ns() -> int:
    return time.time_ns()
