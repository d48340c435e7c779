"""The NATS connection every service uses: msgpack Structs in, msgpack Structs out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from common import messages
from common.config import ServerArgs
from common.logging import get_logger

log = get_logger("bus")

Handler = Callable[[messages.Message, dict[str, str]], Awaitable[None]]


class Bus:
    def __init__(self, args: ServerArgs, name: str) -> None:
        self.args = args
        self.name = name
        self.nc: Client | None = None
        # called with False when the connection to NATS drops, True when it is back
        self.on_connection_change: list[Callable[[bool], None]] = []
        self._handling: set[asyncio.Task] = set()  # handlers of unordered subscriptions
        self._unordered: list = []  # their subscriptions, drained first on close
        self.reconnects = 0  # times the client came back, to the same node or another one
        self.rtt = 0.0  # seconds of the last PING/PONG with the node this client is on

    async def connect(self, attempts: int = 120) -> None:
        """Connect, retrying while the server is not up yet (services may start first)."""
        opts = dict(
            # several seeds of a NATS cluster: comma-separated (the client learns the rest)
            servers=[u.strip() for u in (self.args.nats_url or "nats://127.0.0.1:4222").split(",")],
            name=self.name,
            # shuffled (nats-py's default): the services spread over the nodes, so one node's
            # death moves a share of them, not all
            dont_randomize=False,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )
        if self.args.nats_user:
            opts.update(user=self.args.nats_user, password=self.args.nats_password)
        if self.args.nats_token:
            opts["token"] = self.args.nats_token
        for attempt in range(attempts):
            try:
                self.nc = await nats.connect(**opts)
                return
            except Exception as exc:  # noqa: BLE001 - any failure to connect is retried
                if attempt == attempts - 1:
                    raise
                log.info("waiting for NATS", url=opts["servers"][0], error=str(exc))
                await asyncio.sleep(0.5)

    async def _on_error(self, exc: Exception) -> None:
        log.warning("nats error", error=str(exc))

    async def _on_disconnect(self) -> None:
        log.warning("nats disconnected")
        self._notify(False)

    async def _on_reconnect(self) -> None:
        self.reconnects += 1
        log.info("nats reconnected", server=str(self.nc.connected_url.netloc)
                 if self.nc is not None and self.nc.connected_url else None)
        self._notify(True)

    def _notify(self, up: bool) -> None:
        for callback in self.on_connection_change:
            try:
                callback(up)
            except Exception:  # noqa: BLE001
                log.exception("connection callback failed")

    async def measure_rtt(self) -> None:
        """A PING/PONG with our node: the round trip each hop through NATS pays twice (sender
        to its node, receiver from its node), plus a route when they are on different nodes.

        Never with a short timeout: nats-py cancels the PONG's future on a timeout, and the
        late PONG then ends the client's read loop (InvalidStateError): it hears nothing until
        its own pings find the connection stale, 15 s later (a leak in test_faults on a loaded
        machine). A PONG missing for 30 s means a dead connection, which those pings find first
        and replace, forgetting the futures of the old one."""
        if not self.connected:
            return
        try:
            self.rtt = await self.nc.rtt(timeout=30)  # type: ignore[union-attr]
        except nats.errors.Error:
            pass  # cut off meanwhile: the reconnect count says so

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def publish(
        self, subject: str, msg: messages.Message, headers: dict[str, str] | None = None
    ) -> None:
        assert self.nc is not None
        await self.nc.publish(subject, messages.encode(msg), headers=headers or None)

    async def publish_acked(
        self, subject: str, msg: messages.Message, headers: dict[str, str] | None = None,
        timeout: float = 5.0,
    ) -> messages.ReceiptOut:
        """Publish and wait until a subscriber has received it; returns who did.

        Plain NATS drops a message nobody listens to without a word. This one fails at once
        with `nats.errors.NoRespondersError` when nobody listens (e.g. the only tokenizer is
        restarting), and with `nats.errors.TimeoutError` when no receipt comes in `timeout`.
        """
        assert self.nc is not None
        reply = await self.nc.request(subject, messages.encode(msg), timeout=timeout,
                                      headers=headers or None)
        receipt = messages.decode(reply.data)
        assert isinstance(receipt, messages.ReceiptOut), receipt
        return receipt

    async def probe(self, subject: str, msg: messages.Message, timeout: float) -> bool | None:
        """Whether anyone takes messages on `subject`, by a message its handler ignores,
        acknowledged on receipt: True, yes; False, nobody listens (NATS drops a closed
        connection's subscriptions at once, so a killed process gives this at once); None, no
        receipt within `timeout` (hung, starved of CPU for that long, or cut off)."""
        try:
            await self.publish_acked(subject, msg, timeout=timeout)
            return True
        except nats.errors.NoRespondersError:
            return False
        except nats.errors.Error:
            return None

    async def request(self, subject: str, msg: messages.Message,
                      timeout: float) -> messages.Message:
        """Ask one responder (`subscribe_requests` on the other side) and return its answer."""
        assert self.nc is not None
        reply = await self.nc.request(subject, messages.encode(msg), timeout=timeout)
        return messages.decode(reply.data)

    async def subscribe(self, subject: str, handler: Handler, queue: str = "",
                        ordered: bool = True) -> None:
        """Deliver each decoded message to `handler`; a failing handler never kills the service.

        A message sent with `publish_acked` is acknowledged on receipt, before the handler
        runs. NATS hands one subscription's messages over one at a time, so with `ordered`
        a message waits (unacknowledged) until the handler of the one before it returns. A
        handler that may wait on someone else (the tokenizer's, which waits for a scheduler's
        receipt, seconds when that scheduler has just died) takes `ordered=False`: each
        message is acknowledged at once and handled in a task of its own, in no set order."""
        assert self.nc is not None
        service, _, instance_id = self.name.partition(":")
        receipt = messages.encode(messages.ReceiptOut(service=service, instance_id=instance_id))

        async def handle(raw: Msg) -> None:
            try:
                msg = messages.decode(raw.data)
            except Exception as exc:  # noqa: BLE001
                log.error("undecodable message", subject=raw.subject, error=str(exc))
                return
            try:
                await handler(msg, dict(raw.headers or {}))
            except Exception:  # noqa: BLE001
                log.exception("handler failed", subject=raw.subject)

        async def on_msg(raw: Msg) -> None:
            if raw.reply:
                try:
                    await raw.respond(receipt)
                except Exception as exc:  # noqa: BLE001 - the sender's timeout covers it
                    log.warning("receipt not sent", subject=raw.subject, error=str(exc))
            if ordered:
                await handle(raw)
                return
            task = asyncio.create_task(handle(raw))
            self._handling.add(task)
            task.add_done_callback(self._handling.discard)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=-1,
                                      pending_bytes_limit=-1)
        if not ordered:
            self._unordered.append(sub)
        await self.nc.flush()  # the server knows the subscription before anyone relies on it

    async def subscribe_requests(
        self, subject: str, handler: Callable[[messages.Message], Awaitable[messages.Message]],
        queue: str = "",
    ) -> None:
        """Request/reply: the handler's return value goes back to the asker (with `queue`, one
        member of the queue group answers each request)."""
        assert self.nc is not None

        async def on_msg(raw: Msg) -> None:
            try:
                reply = await handler(messages.decode(raw.data))
                await raw.respond(messages.encode(reply))
            except Exception:  # noqa: BLE001
                log.exception("request handler failed", subject=raw.subject)

        await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        await self.nc.flush()  # the server knows the subscription before anyone relies on it

    async def gather(
        self, subject: str, msg: messages.Message, expect: int, timeout: float
    ) -> list[messages.Message]:
        """Publish to many responders and collect up to `expect` replies within `timeout`."""
        assert self.nc is not None
        inbox = self.nc.new_inbox()
        replies: list[messages.Message] = []
        done = asyncio.Event()

        async def on_reply(raw: Msg) -> None:
            replies.append(messages.decode(raw.data))
            if len(replies) >= expect:
                done.set()

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(subject, messages.encode(msg), reply=inbox)
            if expect > 0:
                try:
                    await asyncio.wait_for(done.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()
        return replies

    async def flush(self) -> None:
        if self.nc is not None:
            await self.nc.flush()

    async def close(self, grace: float = 10.0) -> None:
        """Drain: no new messages, the ones received are handled (unordered handlers get
        `grace` seconds to finish: each was acknowledged, so each is owed its hand-off)."""
        if self.nc is not None and not self.nc.is_closed and self._unordered:
            for sub in self._unordered:
                try:
                    await sub.drain()
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
            if self._handling:
                await asyncio.wait(set(self._handling), timeout=grace)
        for task in list(self._handling):
            task.cancel()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001
                await self.nc.close()
