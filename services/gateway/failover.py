"""Handing requests on so that none vanishes, and when a stage behind the gateway is lost,
moving or failing the requests it held.

A dead scheduler's requests move to live ones (or fail with a 503 when none is left), a dead
tokenizer's unaccepted requests fail at once. A NATS node that dies may take messages in flight
with it (core NATS delivers at most once): a request whose output then skips tokens, or that
hears nothing for RESUME_AFTER_S after a reconnect anywhere, resumes the same way, after the
tokens its client has. Only a gateway cut off from NATS for --heartbeat-timeout fails its
requests. Every failure is a 503 the client may retry (`docs/reliability.md`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

from common import tracing
from common.bus import Bus
from common.logging import get_logger, request_logger
from common.messages import AbortReq, ErrorOut, StatsOut, TokenizeOut, TokenizeReq
from common.peers import PeerTable
from common.subjects import Subjects
from services.gateway.protocol import APIError
from services.gateway.tracker import SubRequest, Tracker

log = get_logger("gateway")

T = TypeVar("T")
TOKENIZER_WAIT_S = 1.0  # a request waits this long for a tokenizer (one restarting) before 503
# After a reconnect anywhere, a request silent this long lost its output on the way (a decode
# step of the tiny model under load is tens of ms, of SmolLM2 on 2 cores ~0.1 s): resuming one
# that was only slow costs a recompute of its prefix, never a wrong token.
RESUME_AFTER_S = 1.0
WATCH_TICK_S = 0.1
# A request handed off again after this many hand-offs without a receipt is a 503.
HAND_OFF_RESENDS = 2


class _NoReceipt(Exception):
    """No receipt for a hand-off in time: the request or the receipt may be lost."""


class Failover:
    def __init__(self, bus: Bus, subjects: Subjects, peers: PeerTable, tracker: Tracker,
                 probe: Callable[[], StatsOut], timeout: float) -> None:
        self.bus = bus
        self.subjects = subjects
        self.peers = peers
        self.tracker = tracker
        self.probe = probe  # the message a probe sends (our heartbeat, which schedulers ignore)
        self.timeout = timeout  # --heartbeat-timeout
        self.resumed: Counter[str] = Counter()  # requests moved or resumed, by why
        self.cut_since: float | None = None  # when this gateway lost NATS (None: connected)
        self.gaps: dict[str, SubRequest] = {}  # rid -> a request whose output skipped tokens
        tracker.on_gap = lambda sub: self.gaps.setdefault(sub.msg.rid, sub)

    async def hand_off(self, sub: SubRequest) -> None:
        """Hand a request to a tokenizer and note which one took it (`sub.tokenizer_id`).

        Plain NATS would drop it without a word while no tokenizer listens (the only one is
        restarting); here that is a 503 after a short wait instead of a hang. A hand-off whose
        receipt never comes (the NATS node between died with the request or the receipt in it,
        or the tokenizer died on receiving it) is made again under a fresh rid, the first copy
        aborted by its own, wherever it got to (`Tracker.move`): a node's death costs the
        request one --heartbeat-timeout and a resend, not a 503. Only after HAND_OFF_RESENDS
        of those is it a 503 (tokenizer_unreachable)."""
        for resends_left in range(HAND_OFF_RESENDS, -1, -1):
            try:
                receipt = await self._to_tokenizer(lambda: self.bus.publish_acked(
                    self.subjects.tokenizer, sub.msg, sub.headers, timeout=self.timeout),
                    "the request could not be handed to a tokenizer", resend=resends_left > 0)
                sub.tokenizer_id = receipt.instance_id
                return
            except _NoReceipt:
                old = sub.msg.rid
                await self.bus.publish(self.subjects.abort,
                                       AbortReq(rid=old, reason="resent (no receipt)"))
                if self.tracker.subs.get(old) is not sub:
                    return  # its response ended meanwhile (failed, or the client left)
                msg = self.tracker.move(sub, sub.msg.scheduler_id)  # where it was going
                self.resumed["no_receipt"] += 1
                request_logger(msg.rid, tracing.trace_id(sub.headers)).warning(
                    "no tokenizer receipt; handed off again", replaces=old,
                    timeout=self.timeout)

    async def tokenize(self, msg: TokenizeReq) -> TokenizeOut:
        """/tokenize's question to any tokenizer (request/reply), with `hand_off`'s wait."""
        reply = await self._to_tokenizer(lambda: self.bus.request(
            self.subjects.tokenize, msg, timeout=self.timeout), "no tokenizer answered")
        if isinstance(reply, ErrorOut):
            raise APIError(reply.message, reply.param, reply.status, reply.err_type, reply.code)
        assert isinstance(reply, TokenizeOut), reply
        return reply

    async def _to_tokenizer(self, send: Callable[[], Awaitable[T]], failed: str,
                            resend: bool = False) -> T:
        """`send()`, again while no tokenizer listens, for up to TOKENIZER_WAIT_S; then a 503.
        `resend`: no answer in time raises _NoReceipt (the caller sends it again) instead."""
        deadline = time.monotonic() + TOKENIZER_WAIT_S
        while True:
            try:
                return await send()
            except nats.errors.NoRespondersError:
                if time.monotonic() >= deadline:
                    raise APIError("no tokenizer is available; retry shortly", None, 503,
                                   "service_unavailable", "no_tokenizer") from None
                await asyncio.sleep(0.1)
            except nats.errors.Error as exc:  # timeout, or NATS itself is unreachable
                timeout = isinstance(exc, nats.errors.TimeoutError)
                if timeout and resend:
                    raise _NoReceipt from None
                why = f"no answer in {self.timeout:g}s" if timeout else exc
                raise APIError(f"{failed} ({why}); retry shortly", None, 503,
                               "service_unavailable", "tokenizer_unreachable") from None

    # -- scheduler ------------------------------------------------------------------------------
    async def scheduler_gone(self, scheduler_id: str) -> bool:
        if await self._answers(scheduler_id):
            return False  # heartbeats late, yet it is there: a busy machine, not a death
        await self.scheduler_lost(scheduler_id)
        return True

    async def _answers(self, scheduler_id: str) -> bool:
        """Whether a scheduler whose heartbeats are late still takes messages on its subject.

        NATS drops a closed connection's subscriptions at once, so a process that is gone
        (killed, crashed) gives 'no responders' at once; one that is alive but starved of CPU
        acknowledges the probe."""
        try:
            await self.bus.publish_acked(self.subjects.scheduler_instance(scheduler_id),
                                         self.probe(), timeout=self.timeout)
            return True
        except nats.errors.Error:  # no responders, or no receipt in time: hung or cut off
            return False

    async def scheduler_lost(self, scheduler_id: str) -> None:
        """Move the requests a dead scheduler owned to live ones; with none left, fail them.

        A moved request resumes after the tokens this gateway already delivered (the engine
        recomputes their KV and samples by position, so greedy and seeded output continue
        exactly); `Tracker.deliver` drops the replayed text and any late output of the dead one.
        Its copy there is aborted first, in case that scheduler was only silent, not dead.
        """
        victims = self.tracker.owned_by(scheduler_id)
        if not victims:
            return
        load = self.peers.load("scheduler")
        log.warning("scheduler lost", scheduler_id=scheduler_id, requests=len(victims),
                    survivors=list(load))
        if not load:
            self.fail_unavailable(victims, "scheduler_lost",
                                  f"the scheduler serving this request ({scheduler_id}) stopped "
                                  "responding and no other scheduler is alive; retry shortly")
            return
        for sub in victims:
            target = min(load, key=load.__getitem__)
            load[target] += 1
            await self._move(sub, target, "scheduler_lost")

    async def _move(self, sub: SubRequest, target: str | None, why: str) -> None:
        """Resume `sub` on `target` (None: any scheduler) after the tokens its client has; the
        copy it leaves is aborted by its own rid (`Tracker.move`), wherever it still runs."""
        old = sub.msg.rid
        msg = self.tracker.move(sub, target)
        self.resumed[why] += 1
        await self.bus.publish(self.subjects.abort, AbortReq(rid=old, reason=f"resumed ({why})"))
        request_logger(msg.rid, tracing.trace_id(sub.headers)).info(
            "request moved", scheduler_id=target, resumed_after=len(msg.output_ids), why=why,
            replaces=old)
        try:
            await self.hand_off(sub)
        except APIError as exc:
            self.tracker.deliver(ErrorOut(rid=msg.rid, message=exc.message, status=exc.status,
                                          err_type=exc.err_type, code=exc.code))

    # -- tokenizer ------------------------------------------------------------------------------
    async def tokenizer_gone(self, tokenizer_id: str) -> bool:
        self.tokenizer_lost(tokenizer_id)
        return True

    def tokenizer_lost(self, tokenizer_id: str) -> None:
        """Fail at once the requests a dead tokenizer took but no scheduler accepted yet."""
        victims = [s for s in self.tracker.unfinished()
                   if s.tokenizer_id == tokenizer_id and s.scheduler_id is None]
        if victims:
            log.warning("tokenizer lost", tokenizer_id=tokenizer_id, requests=len(victims))
        self.fail_unavailable(victims, "tokenizer_lost",
                              f"the tokenizer handling this request ({tokenizer_id}) stopped "
                              "responding; retry shortly")

    # -- NATS -----------------------------------------------------------------------------------
    def on_connection(self, up: bool) -> None:
        """Cut off, the gateway keeps its streams: the client's NATS fails over to another node
        (or the same one, restarted) within a second, and `watch` then resumes what lost output
        on the way. Only a cut longer than --heartbeat-timeout fails them (`watch`)."""
        now = time.monotonic()
        if up:
            self.cut_since = None
            self.suspect_all(now)
        elif self.cut_since is None:
            self.cut_since = now
            log.warning("NATS connection lost; in-flight requests wait for the reconnect",
                        requests=len(self.tracker.unfinished()))

    def suspect_all(self, now: float) -> None:
        """A NATS client reconnected (ours or a peer's): output on the way then may be lost."""
        for sub in self.tracker.unfinished():
            if sub.suspect_since is None:
                sub.suspect_since = now

    async def watch(self) -> None:
        """Resume each request whose output skipped tokens or stalled after a reconnect; fail
        them all when this gateway stays cut off from NATS."""
        while True:
            await asyncio.sleep(WATCH_TICK_S)
            now = time.monotonic()
            if not self.bus.connected:
                if self.cut_since is not None and now - self.cut_since > self.timeout:
                    self.cut_since = now  # what comes in meanwhile is failed in its turn
                    self.fail_unavailable(self.tracker.unfinished(), "nats_disconnected",
                                          "the gateway lost its connection to NATS while this "
                                          "request ran; retry shortly")
                continue
            gaps, self.gaps = self.gaps, {}
            for sub in self.tracker.unfinished():
                if sub.aborting:
                    continue  # its final 'abort' output ends it, or the deadline does
                if sub.msg.rid in gaps:
                    await self._resume(sub, "gap")
                elif sub.suspect_since is not None and \
                        now - max(sub.heard, sub.suspect_since) > RESUME_AFTER_S:
                    await self._resume(sub, "stalled")

    async def _resume(self, sub: SubRequest, why: str) -> None:
        """On the scheduler it ran on (its prefix is cached there) if that one lives."""
        alive = self.peers.load("scheduler")
        target = sub.scheduler_id if sub.scheduler_id in alive else (
            min(alive, key=alive.__getitem__) if alive else None)
        try:
            await self._move(sub, target, why)
        except Exception:  # noqa: BLE001 - e.g. cut off again: the watcher goes on regardless
            log.exception("resuming a request failed", rid=sub.msg.rid, why=why)
            sub.suspect_since = time.monotonic()  # tried again once RESUME_AFTER_S has passed

    def fail_unavailable(self, subs: list[SubRequest], code: str, message: str) -> None:
        """End each of `subs` with a 503 the client may retry."""
        for sub in subs:
            self.tracker.deliver(ErrorOut(rid=sub.msg.rid, status=503,
                                          err_type="service_unavailable", code=code,
                                          message=message))
