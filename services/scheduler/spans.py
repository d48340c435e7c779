"""The scheduler's spans of each request, recorded from what each engine step reports.

One BatchTokenOut carries many requests, so no message header can hold their trace contexts:
the scheduler keeps each request's context from its arrival and records its spans itself,
from the step's outputs (`TokenOut`) and `EngineCore.last_step` (`StepStats`):

    generate   arrival -> finish (CONSUMER, child of the gateway's HTTP span)
      queued   arrival -> first scheduled step; again from each retraction to readmission
      prefill  one per chunk: the step that computed it (recompute after a retraction too)
      decode   first token -> finish, with an event `retraction` each time

Only used when tracing is on; the engine core stays free of OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common import tracing
from common.messages import Finish, TokenizedReq, TokenOut
from services.scheduler.core.engine import StepStats


@dataclass
class RequestSpans:
    generate: Any
    queued: Any | None
    queued_ns: int  # when `queued` opened
    decode: Any | None = None
    prefilling: bool = False  # scheduled, no token yet since (re)admission
    chunks: int = 0
    retractions: int = 0
    attrs: dict = field(default_factory=dict)


class SchedulerSpans:
    def __init__(self) -> None:
        self.reqs: dict[str, RequestSpans] = {}
        self._seen_step: StepStats | None = None

    def __len__(self) -> int:
        return len(self.reqs)

    def arrive(self, msg: TokenizedReq, headers: Mapping[str, str]) -> None:
        parent = tracing.extract(headers)
        if parent is None or msg.rid in self.reqs:
            return  # untraced (no context came with it), or a duplicate delivery
        now = tracing.now_ns()
        attrs = {tracing.RID: msg.rid, tracing.USAGE_INPUT_TOKENS: len(msg.input_ids),
                 **tracing.request_attributes(msg.params)}
        if msg.lora_name is not None:
            attrs[tracing.LORA_NAME] = msg.lora_name
        generate = tracing.start_span("generate", parent, "consumer", attrs, now)
        queued = tracing.start_span("queued", generate, attributes={tracing.RID: msg.rid},
                                    start_ns=now)
        self.reqs[msg.rid] = RequestSpans(generate, queued, now)

    def traceparent(self, rid: str) -> str | None:
        """Context for the request's next stage (the detokenizer's span hangs under generate)."""
        spans = self.reqs.get(rid)
        return None if spans is None else tracing.traceparent(spans.generate)

    def after_step(self, outputs: list[TokenOut], step: StepStats, t0: int, t1: int) -> None:
        """Record one engine step that ran from `t0` to `t1` (ns) and produced `outputs`."""
        if not self.reqs:
            return
        if step is not self._seen_step:  # last_step is only replaced by a step that ran
            self._seen_step = step
            for rid in step.retracted_rids:
                self._retracted(rid, t0)
            sampled = {o.rid for o in outputs if o.token_ids}
            for rid, n in zip(step.scheduled_rids, step.num_new, strict=True):
                self._scheduled(rid, n, rid in sampled, t0, t1, step)
        for out in outputs:
            if out.finish is not None:
                self.finish(out, t1)

    def _retracted(self, rid: str, t: int) -> None:
        s = self.reqs.get(rid)
        if s is None:
            return
        s.retractions += 1
        event = {tracing.RETRACTIONS: s.retractions}
        (s.decode or s.generate).add_event("retraction", event, timestamp=t)
        s.prefilling = False
        s.queued_ns = t
        s.queued = tracing.start_span("queued", s.generate, start_ns=t,
                                      attributes={tracing.RID: rid, "tokenline.retracted": True})

    def _scheduled(self, rid: str, n: int, sampled: bool, t0: int, t1: int,
                   step: StepStats) -> None:
        s = self.reqs.get(rid)
        if s is None:
            return
        if s.queued is not None:
            # A request that arrived while the worker was about to drain its inbox joins the
            # step that was already timed: it starts no earlier than it arrived.
            t0 = max(t0, s.queued_ns)
            s.queued.end(end_time=t0)
            s.queued = None
            s.prefilling = True
        if s.prefilling:
            s.chunks += 1
            span = tracing.start_span("prefill", s.generate, start_ns=t0, attributes={
                tracing.RID: rid, "tokenline.prefill.chunk": s.chunks,
                "tokenline.prefill.tokens": n, "tokenline.recompute": s.retractions > 0,
                "tokenline.step.num_tokens": step.num_tokens,
            })
            span.end(end_time=t1)
            if sampled:  # the last chunk: its token is the first of the decode phase
                s.prefilling = False
                if s.decode is None:
                    s.decode = tracing.start_span("decode", s.generate, start_ns=t1,
                                                  attributes={tracing.RID: rid})

    def finish(self, out: TokenOut, t: int) -> None:
        s = self.reqs.pop(out.rid, None)
        if s is None:
            return
        if s.queued is not None:
            s.queued.end(end_time=t)
        if s.decode is not None:
            tracing.end_with_finish(s.decode, out.finish, t, {
                tracing.USAGE_OUTPUT_TOKENS: out.completion_tokens,
                tracing.RETRACTIONS: out.retractions})
        usage = tracing.usage_attributes(out.prompt_tokens, out.completion_tokens,
                                         out.cached_tokens, out.retractions)
        tracing.end_with_finish(s.generate, out.finish, t, usage if out.prompt_tokens else None)

    def close_all(self, message: str) -> None:
        """End every open span (the service is stopping), so the traces still export."""
        finish = Finish(kind="error", message=message)
        for rid in list(self.reqs):
            self.finish(TokenOut(rid=rid, gateway_id="", token_ids=[], finish=finish),
                        tracing.now_ns())
