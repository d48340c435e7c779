"""The detokenizer service: one BatchTokenOut per engine step in, one BatchTextOut per gateway."""

from __future__ import annotations

import time
from collections import defaultdict

from tokenizers import Tokenizer

from common.config import ServerArgs
from common.logging import get_logger
from common.messages import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    Message,
    StatsOut,
    TextOut,
)
from common.modelstore import model_info, prepare_model
from common.service import Service
from services.detokenizer.incremental import IncrementalText

log = get_logger("detokenizer")

STALE_S = 600.0


class DetokenizerService(Service):
    name = "detokenizer"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                          args.model)
        self.tokenizer = Tokenizer.from_file(str(info.tokenizer_json))
        # One state per (request, scheduler): a request moved to another scheduler restarts its
        # text there, and late output of the one it left never mixes into it.
        self.states: dict[tuple[str, str], IncrementalText] = {}
        self.last_seen: dict[tuple[str, str], float] = {}

    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.detokenizer(self.instance_id), self.on_tokens)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)
        self.spawn(self._sweep())

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.states)
        return s

    async def on_abort(self, msg: Message, headers: dict[str, str]) -> None:
        # The scheduler's final 'abort' output still comes through and ends the stream; state
        # for a request the scheduler never saw would otherwise linger, so drop it here too.
        if isinstance(msg, AbortReq):
            if msg.abort_all:
                self.states.clear()
                self.last_seen.clear()
            elif msg.rid:
                for key in [k for k in self.states if k[0] == msg.rid
                            and msg.scheduler_id in (None, k[1])]:
                    self.states.pop(key, None)
                    self.last_seen.pop(key, None)

    async def on_tokens(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, BatchTokenOut):
            return
        by_gateway: dict[str, list[TextOut]] = defaultdict(list)
        now = time.monotonic()
        for item in msg.items:
            key = (item.rid, msg.scheduler_id)
            state = self.states.get(key)
            if state is None or item.prior_ids is not None:
                state = IncrementalText(self.tokenizer, item.stop, item.skip_special_tokens,
                                        item.include_stop_str_in_output)
                # A resumed request: decode its earlier tokens again (a fresh DecodeStream has
                # no left context); the text restarts from the beginning, the gateway trims it.
                state.push(item.prior_ids or [])
                self.states[key] = state
            state.push(item.token_ids)
            finished = item.finish is not None
            matched = item.finish.matched if finished and item.finish.kind == "stop" else None
            text = state.take(finished, matched if isinstance(matched, str) else None)
            if finished:
                self.states.pop(key, None)
                self.last_seen.pop(key, None)
            else:
                self.last_seen[key] = now
            by_gateway[item.gateway_id].append(TextOut(
                rid=item.rid,
                text=text,
                token_ids=item.token_ids,
                finish=item.finish,
                prompt_tokens=item.prompt_tokens,
                completion_tokens=item.completion_tokens,
                cached_tokens=item.cached_tokens,
                logprobs=item.logprobs,
                scheduler_id=msg.scheduler_id,
                queue_time=item.queue_time,
                retractions=item.retractions,
            ))
        for gateway_id, items in by_gateway.items():
            await self.bus.publish(self.subjects.gateway(gateway_id), BatchTextOut(items=items),
                                   headers)

    async def _sweep(self) -> None:
        """Drop state of requests nobody has sent tokens for in a long time (a dead scheduler)."""
        import asyncio

        while True:
            await asyncio.sleep(30)
            cutoff = time.monotonic() - STALE_S
            for key in [k for k, t in self.last_seen.items() if t < cutoff]:
                self.states.pop(key, None)
                self.last_seen.pop(key, None)
