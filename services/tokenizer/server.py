"""The tokenizer service: GenerateReq in, TokenizedReq out to a scheduler (or an error back)."""

from __future__ import annotations

import time

import nats.errors
import structlog

from common import tracing
from common.config import ServerArgs
from common.logging import get_logger, request_logger
from common.messages import AbortReq, ErrorOut, GenerateReq, Message, StatsOut, TokenizedReq
from common.modelstore import model_info, prepare_model
from common.service import Service
from common.subjects import TOKENIZER_QUEUE
from services.tokenizer.tokenize import InputError, TextTokenizer

log = get_logger("tokenizer")

ABORT_MEMORY_S = 30.0


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                               args.model, args.chat_template)
        self.max_model_len = args.max_model_len or self.info.max_model_len
        self.tok = TextTokenizer(self.info)
        self.in_flight: set[str] = set()
        self.aborted: dict[str, float] = {}

    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.tokenizer, self.on_request, queue=TOKENIZER_QUEUE)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.in_flight)
        return s

    async def on_abort(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, AbortReq) and msg.rid and msg.scheduler_id is None:
            now = time.monotonic()
            self.aborted[msg.rid] = now + ABORT_MEMORY_S
            self.aborted = {r: t for r, t in self.aborted.items() if t > now}

    async def on_request(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, GenerateReq):
            return
        self.in_flight.add(msg.rid)
        try:
            if msg.rid in self.aborted:
                return  # the scheduler never hears of it
            with structlog.contextvars.bound_contextvars(rid=msg.rid,
                                                         trace_id=tracing.trace_id(headers)):
                try:
                    out = self._traced_tokenize(msg, headers)
                except InputError as exc:
                    log.info("request rejected", error=str(exc), param=exc.param)
                    await self.bus.publish(
                        self.subjects.gateway(msg.gateway_id),
                        ErrorOut(rid=msg.rid, message=str(exc), status=exc.status,
                                 param=exc.param),
                        headers,
                    )
                    return
                except Exception as exc:  # noqa: BLE001 - a bug here must not lose the request
                    log.exception("tokenization failed")
                    await self.bus.publish(self.subjects.gateway(msg.gateway_id), ErrorOut(
                        rid=msg.rid, message=f"tokenization failed: {exc}", status=500,
                        err_type="server_error"), headers)
                    return
            subject = (self.subjects.scheduler_instance(msg.scheduler_id) if msg.scheduler_id
                       else self.subjects.scheduler)
            await self._forward(subject, out, headers)
        finally:
            self.in_flight.discard(msg.rid)

    async def _forward(self, subject: str, out: TokenizedReq, headers: dict[str, str]) -> None:
        """To a scheduler, with a receipt: when none listens (the only one is restarting, or the
        one a moved request is pinned to is gone) the gateway hears so at once, not never."""
        try:
            await self.bus.publish_acked(subject, out, headers,
                                         timeout=self.args.heartbeat_timeout)
            return
        except nats.errors.NoRespondersError:
            message, code = "no scheduler is available; retry shortly", "no_scheduler"
        except nats.errors.Error as exc:  # no receipt in time, or NATS is unreachable
            message = f"the request could not be handed to a scheduler ({exc}); retry shortly"
            code = "scheduler_unreachable"
        request_logger(out.rid, tracing.trace_id(headers)).warning("request not forwarded",
                                                                  error=message)
        await self.bus.publish(self.subjects.gateway(out.gateway_id), ErrorOut(
            rid=out.rid, message=message, status=503, err_type="service_unavailable", code=code),
            headers)

    def _traced_tokenize(self, msg: GenerateReq, headers: dict[str, str]) -> TokenizedReq:
        parent = tracing.extract(headers) if tracing.enabled() else None
        if parent is None:
            return self.tokenize(msg)
        # The scheduler's spans hang under the gateway's, not this one: the headers go on as
        # they came, so each stage's part of the request sits side by side under the request.
        span = tracing.start_span("tokenize", parent, "consumer", {tracing.RID: msg.rid})
        try:
            out = self.tokenize(msg)
        except Exception as exc:  # the span ends with the request's error, whatever it was
            kind = "invalid_request" if isinstance(exc, InputError) else "server_error"
            tracing.set_error(span, str(exc), kind)
            span.end()
            raise
        span.set_attribute(tracing.USAGE_INPUT_TOKENS, len(out.input_ids))
        span.end()
        return out

    def tokenize(self, msg: GenerateReq) -> TokenizedReq:
        if msg.input_ids is not None:
            ids = list(msg.input_ids)
            bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise InputError(f"token id {bad} is outside the vocabulary "
                                 f"[0, {self.info.vocab_size})", "prompt")
        elif msg.messages is not None:
            ids = self.tok.encode_chat(msg.messages, msg.add_generation_prompt)
        else:
            ids = self.tok.encode(msg.text or "")
        if not ids:
            raise InputError("the prompt is empty", "prompt")
        params = msg.params
        room = self.max_model_len - len(ids)
        if room <= 0:  # no room for even one token, whatever max_tokens says
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(ids)} tokens.",
                "messages" if msg.messages is not None else "prompt")
        if params.max_new_tokens is None:
            params.max_new_tokens = room
        elif len(ids) + params.max_new_tokens > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_new_tokens} tokens ({len(ids)} in the "
                f"prompt, {params.max_new_tokens} for the completion). Please reduce the prompt "
                "or max_tokens.",
                "max_tokens",
            )
        return TokenizedReq(
            rid=msg.rid,
            gateway_id=msg.gateway_id,
            input_ids=ids,
            params=params,
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            output_ids=msg.output_ids,
            cache_salt=msg.cache_salt,
        )
