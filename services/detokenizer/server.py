"""The detokenizer service: one BatchTokenOut per engine step in, one BatchTextOut per gateway."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass

from tokenizers import Tokenizer

from common import tracing
from common.config import ServerArgs
from common.incremental import IncrementalText
from common.logging import get_logger, request_logger
from common.messages import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    Finish,
    Message,
    StatsOut,
    TextOut,
    TokenOut,
)
from common.modelstore import model_info, prepare_model
from common.service import Service

log = get_logger("detokenizer")

STALE_S = 600.0
# An aborted request's state waits this long for its scheduler's final 'abort' output (which
# ends the client's stream); a request no scheduler ever saw sends none.
ABORTED_GRACE_S = 10.0
# How often stale and aborted states are looked for: often enough that an aborted request's
# state goes within a few seconds of its grace (a pass reads each state's clock, nothing more).
SWEEP_EVERY_S = 2.0


@dataclass
class Decoding:
    """One request's text on its way out, and when its scheduler last sent tokens."""

    text: IncrementalText
    last_seen: float
    count: int = 0  # output tokens decoded (resumed ones' included): where the next must start
    trace_id: str | None = None  # for its log lines
    aborted: bool = False  # an abort was heard: its final output is on the way, or never comes


class DetokenizerService(Service):
    name = "detokenizer"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                          args.model)
        self.tokenizer = Tokenizer.from_file(str(info.tokenizer_json))
        # One state per (request, scheduler): a request moved to another scheduler restarts its
        # text there, and late output of the one it left never mixes into it.
        self.states: dict[tuple[str, str], Decoding] = {}
        self.spans: dict = {}  # rid -> its open `detokenize` span (tracing on only)
        self.traced = False

    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.detokenizer(self.instance_id), self.on_tokens)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)
        self.traced = tracing.enabled()
        self.spawn(self._sweep())

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.states)
        return s

    async def on_abort(self, msg: Message, headers: dict[str, str]) -> None:
        """An aborted request's outputs keep coming until the scheduler's final 'abort' one,
        which ends the client's stream: its state stays to decode them in order (dropped
        there, or after ABORTED_GRACE_S when no scheduler ever saw the request). A request
        moved off a scheduler (`scheduler_id` set) restarts elsewhere: that state goes now."""
        if not isinstance(msg, AbortReq):
            return
        if msg.rid and msg.scheduler_id is not None:
            for key in [k for k in self.states if k == (msg.rid, msg.scheduler_id)]:
                del self.states[key]
            return
        for key, state in self.states.items():
            if msg.abort_all or key[0] == msg.rid:
                state.aborted = True
        for rid in list(self.spans) if msg.abort_all else [msg.rid] if msg.rid else []:
            self._end_span(rid, Finish(kind="abort", message=msg.reason))

    async def on_tokens(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, BatchTokenOut):
            return
        by_gateway: dict[str, list[TextOut]] = defaultdict(list)
        now = time.monotonic()
        arrived = tracing.now_ns() if self.traced else 0
        headers = headers or {}
        for i, item in enumerate(msg.items):
            out = self._decode(item, msg.scheduler_id, now, headers.get(tracing.item_header(i)))
            by_gateway[item.gateway_id].append(out)
        for gateway_id, items in by_gateway.items():
            await self.bus.publish(self.subjects.gateway(gateway_id), BatchTextOut(items=items))
        if self.traced and (headers or self.spans):
            self._trace(msg, headers, arrived)

    def _decode(self, item: TokenOut, scheduler_id: str, now: float,
                traceparent: str | None) -> TextOut:
        """The item's text, or, when a message before it was lost (a NATS node died with it),
        no text and its offset: the gateway sees the count is off and resumes the request."""
        key = (item.rid, scheduler_id)
        state = self.states.get(key)
        if state is None or item.prior_ids is not None:
            # A resumed request decodes its earlier tokens again (a fresh DecodeStream has
            # no left context); the text restarts from the beginning, the gateway trims it.
            prior = item.prior_ids or []
            state = Decoding(IncrementalText(
                self.tokenizer, item.stop, item.skip_special_tokens,
                item.include_stop_str_in_output, prior=prior), now, len(prior),
                tracing.trace_id({tracing.TRACEPARENT: traceparent} if traceparent else None))
            self.states[key] = state
        if item.offset is not None and item.offset != state.count:
            del self.states[key]  # the text cannot go on without the tokens that were lost
            request_logger(item.rid, state.trace_id, "detokenizer").warning(
                "output lost on the way here", expected=state.count, got=item.offset)
            return TextOut(rid=item.rid, text="", token_ids=[], offset=item.offset,
                           scheduler_id=scheduler_id)
        state.text.push(item.token_ids)
        state.count += len(item.token_ids)
        state.last_seen = now
        text = state.text.take_output(item.finish)
        if item.finish is not None:
            del self.states[key]
        return TextOut(
            rid=item.rid,
            text=text,
            token_ids=item.token_ids,
            finish=item.finish,
            offset=item.offset,
            prompt_tokens=item.prompt_tokens,
            completion_tokens=item.completion_tokens,
            cached_tokens=item.cached_tokens,
            logprobs=item.logprobs,
            prompt_logprobs=item.prompt_logprobs,
            scheduler_id=scheduler_id,
            queue_time=item.queue_time,
            retractions=item.retractions,
        )

    def _trace(self, msg: BatchTokenOut, headers: dict[str, str], arrived: int) -> None:
        """Open a request's span at its first output, under the context the scheduler put in
        the item's header; end it with the request."""
        for i, item in enumerate(msg.items):
            if item.first and (tp := (headers or {}).get(tracing.item_header(i))):
                if (moved := self.spans.pop(item.rid, None)) is not None:
                    moved.end()  # resumed on another scheduler: its first part ends here
                self.spans[item.rid] = tracing.start_span(
                    "detokenize", tp, "consumer", {tracing.RID: item.rid}, arrived)
            if item.finish is not None:
                self._end_span(item.rid, item.finish, item.completion_tokens)

    def _end_span(self, rid: str, finish: Finish, completion_tokens: int | None = None) -> None:
        span = self.spans.pop(rid, None)
        if span is not None:
            attrs = ({} if completion_tokens is None
                     else {tracing.USAGE_OUTPUT_TOKENS: completion_tokens})
            tracing.end_with_finish(span, finish, attributes=attrs)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Drop state of requests nobody has sent tokens for in a long time (a dead scheduler),
        or for a while since their abort (a scheduler that never saw them)."""
        for key in [k for k, d in self.states.items()
                    if d.last_seen < now - (ABORTED_GRACE_S if d.aborted else STALE_S)]:
            del self.states[key]
            self._end_span(key[0], Finish(kind="error", message="no output for too long"))
