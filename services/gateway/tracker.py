"""Requests this gateway owns: where their outputs go and when they are overdue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from common.messages import ErrorOut, Finish, GenerateReq, LogprobOut, TextOut


@dataclass
class SubRequest:
    """One sequence the engine generates (a choice of a request with n > 1 is one each)."""

    msg: GenerateReq
    index: int
    queue: asyncio.Queue
    finished: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    scheduler_id: str | None = None
    tokenizer_id: str | None = None  # who took it (until a scheduler accepts it)
    finish: Finish | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    retractions: int = 0
    all_logprobs: list[LogprobOut] = field(default_factory=list)
    prompt_logprobs: list[LogprobOut] | None = None  # one per prompt token, entry 0 null
    # event times on one monotonic clock, for the latency metrics
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    finished_at: float | None = None  # when its final output arrived, not when it was consumed
    headers: dict[str, str] = field(default_factory=dict)  # trace context, kept if it moves
    itls: list[float] = field(default_factory=list)
    # What the tracker has handed to the handler (it may not have consumed it yet): a request
    # moved to another scheduler resumes after these tokens, and its new detokenizer state
    # replays their text, of which the first `skip_chars` characters are dropped.
    delivered_ids: list[int] = field(default_factory=list)
    delivered_chars: int = 0
    skip_chars: int = 0
    migrations: int = 0
    group: str = ""  # the response it belongs to (`Tracker.groups`)
    # After a NATS failover anywhere, output in flight then may be lost: from `suspect_since`
    # until its next output in order, a request that hears nothing is resumed (failover.py).
    heard: float = field(default_factory=time.monotonic)  # its last message from the pipeline
    suspect_since: float | None = None
    aborting: bool = False  # /abort_request asked its end: never resumed, whatever it misses

    @property
    def finish_reason(self) -> str | None:
        return None if self.finish is None else self.finish.kind


@dataclass
class Event:
    index: int
    out: TextOut | ErrorOut | None  # None: the deadline passed


class Tracker:
    """The gateway's request table: every sequence by rid, and each response's sequences."""

    def __init__(self) -> None:
        self.subs: dict[str, SubRequest] = {}
        self.groups: dict[str, list[str]] = {}  # response id -> its sequences' rids
        # Called with a sequence whose output skipped or repeated tokens (a message lost on a
        # NATS node that died): that output is dropped and the sequence resumed (failover.py).
        self.on_gap: Callable[[SubRequest], None] = lambda sub: None

    def __len__(self) -> int:
        return len(self.subs)

    def is_empty(self) -> bool:
        return not self.subs and not self.groups

    def add(self, msg: GenerateReq, index: int, queue: asyncio.Queue) -> SubRequest:
        sub = SubRequest(msg=msg, index=index, queue=queue)
        self.subs[msg.rid] = sub
        return sub

    def open(self, group: str, msgs: list[GenerateReq], headers: dict[str, str]
             ) -> list[SubRequest]:
        """A response's sequences, sharing one queue, under the response's id."""
        queue: asyncio.Queue = asyncio.Queue()
        subs = [self.add(m, i, queue) for i, m in enumerate(msgs)]
        for sub in subs:
            sub.headers = headers
            sub.group = group
        self.groups[group] = [m.rid for m in msgs]
        return subs

    def close(self, group: str) -> None:
        """Forget a response and its sequences."""
        for rid in self.groups.pop(group, []):
            self.subs.pop(rid, None)

    def rids(self, rid: str) -> list[str]:
        """The sequences' rids of a response id; a sequence's own rid stands for itself."""
        return self.groups.get(rid, [rid])

    def of(self, rid: str) -> list[SubRequest]:
        """The sequences `rids(rid)` names that are still tracked."""
        return [self.subs[r] for r in self.rids(rid) if r in self.subs]

    def in_use(self, rid: str) -> bool:
        return rid in self.groups or rid in self.subs

    def accept(self, rid: str, scheduler_id: str) -> None:
        """A scheduler took the request from its queue group: it owns the request now."""
        sub = self.subs.get(rid)
        if sub is not None and sub.scheduler_id is None:
            sub.scheduler_id = scheduler_id
        if sub is not None:
            sub.heard = time.monotonic()

    def unfinished(self) -> list[SubRequest]:
        return [s for s in self.subs.values() if s.finish is None and not s.finished]

    def owned_by(self, scheduler_id: str) -> list[SubRequest]:
        return [s for s in self.unfinished() if s.scheduler_id == scheduler_id]

    def move(self, sub: SubRequest, scheduler_id: str | None) -> GenerateReq:
        """The request again, to resume on `scheduler_id` (None: any) after the tokens
        delivered so far.

        It runs under a rid of its own (`<rid>~<n>`): whatever the copy it replaces still sends
        (from a scheduler that was only silent, or the same scheduler when only a message was
        lost) matches no request here, and aborting that copy by its rid can never stop this
        one, whichever of the two messages arrives first."""
        old = sub.msg.rid
        sub.migrations += 1
        rid = f"{old.split('~', 1)[0]}~{sub.migrations}"
        sub.msg = msgspec.structs.replace(sub.msg, rid=rid, output_ids=list(sub.delivered_ids),
                                          scheduler_id=scheduler_id)
        del self.subs[old]
        self.subs[rid] = sub
        if sub.group in self.groups:
            self.groups[sub.group] = [rid if r == old else r for r in self.groups[sub.group]]
        sub.scheduler_id = scheduler_id
        sub.tokenizer_id = None
        sub.skip_chars = sub.delivered_chars
        sub.suspect_since = None
        sub.heard = time.monotonic()
        return sub.msg

    def deliver(self, out: TextOut | ErrorOut) -> None:
        sub = self.subs.get(out.rid)
        if sub is None:
            return  # a request this gateway already gave up on
        now = time.monotonic()
        if isinstance(out, TextOut):
            if out.scheduler_id and sub.scheduler_id not in (None, out.scheduler_id):
                return  # late output of a scheduler the request was moved off
            if out.offset is not None and out.offset != len(sub.delivered_ids):
                self.on_gap(sub)  # never a token twice, never one missing: resumed instead
                return
            sub.heard, sub.suspect_since = now, None
            if sub.skip_chars:  # a resumed request's replayed text: the client has it
                cut = min(sub.skip_chars, len(out.text))
                out.text = out.text[cut:]
                sub.skip_chars -= cut
            sub.delivered_ids += out.token_ids
            sub.delivered_chars += len(out.text)
            if out.token_ids:
                if sub.first_token is None:
                    sub.first_token = now
                elif sub.last_token is not None:
                    sub.itls.append(now - sub.last_token)
                sub.last_token = now
            if out.scheduler_id:
                sub.scheduler_id = out.scheduler_id
            sub.prompt_tokens = out.prompt_tokens or sub.prompt_tokens
            sub.cached_tokens = out.cached_tokens or sub.cached_tokens
            sub.retractions = max(sub.retractions, out.retractions)
            if out.queue_time is not None:
                sub.queue_time = out.queue_time
            if out.logprobs:
                sub.all_logprobs += out.logprobs
            if out.prompt_logprobs and sub.prompt_logprobs is None:  # resumed: sent once more
                sub.prompt_logprobs = out.prompt_logprobs
            if out.finish is not None:
                sub.finish = out.finish
                sub.finished_at = now
        sub.queue.put_nowait(Event(sub.index, out))


async def events(
    queue: asyncio.Queue, subs: list[SubRequest], first_timeout: float, inter_timeout: float
) -> AsyncIterator[Event]:
    """Outputs of a request's sequences as they come, until every one has finished."""
    pending = len(subs)
    got_any = False
    while pending:
        timeout = inter_timeout if got_any else first_timeout
        try:
            ev: Event = await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            yield Event(-1, None)
            return
        got_any = True
        sub = subs[ev.index]
        if sub.finished:
            continue
        out = ev.out
        if isinstance(out, ErrorOut) or (out is not None and out.finish is not None):
            sub.finished = True
            pending -= 1
        yield ev
