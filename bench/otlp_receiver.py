"""A minimal OTLP trace receiver (HTTP/protobuf, and gRPC) for tests and measurements.

It decodes `ExportTraceServiceRequest`s with opentelemetry-proto and keeps the spans, so a
test can check what the services exported without a collector. Standalone, it only counts:

    python -m bench.otlp_receiver --port 4318    # POST http://127.0.0.1:4318/v1/traces
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import socket
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: str = "unset"
    status_message: str = ""


def _value(v) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_spans(req: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    service=service, name=s.name, trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    kind=KINDS.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                    events=[(e.name, _attrs(e.attributes)) for e in s.events],
                    status=STATUS.get(s.status.code, str(s.status.code)),
                    status_message=s.status.message,
                ))
    return out


class OtlpReceiver:
    """OTLP/HTTP on loopback, in the caller's event loop. `keep=False` only counts spans."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: bool = True) -> None:
        self.host = host
        self.port = port
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.num_spans = 0
        self.num_requests = 0
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1/traces"

    async def start(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        req = ExportTraceServiceRequest.FromString(body)
        self.num_requests += 1
        if self.keep:
            spans = decode_spans(req)
            self.spans += spans
            self.num_spans += len(spans)
        else:
            self.num_spans += sum(len(ss.spans) for rs in req.resource_spans
                                  for ss in rs.scope_spans)
        self._changed.set()
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for s in self.spans:
            by_trace[s.trace_id].append(s)
        return dict(by_trace)

    async def wait_for(self, done: Callable[[], Any], timeout: float) -> Any:
        """Wait until `done()` returns something true (checked on every export)."""
        deadline = time.monotonic() + timeout
        while not (result := done()):
            left = deadline - time.monotonic()
            if left <= 0:
                return result
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass
        return result


class GrpcOtlpReceiver:
    """OTLP/gRPC on loopback, served from grpcio's own threads."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.spans: list[ReceivedSpan] = []
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def start(self) -> GrpcOtlpReceiver:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method's name
                receiver.spans += decode_spans(request)
                return ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)


async def _serve(port: int) -> None:
    receiver = await OtlpReceiver(port=port, keep=False).start()
    print(f"OTLP receiver at {receiver.url}", flush=True)
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        print(f"received {receiver.num_spans} spans in {receiver.num_requests} exports",
              flush=True)
        await receiver.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_receiver")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
