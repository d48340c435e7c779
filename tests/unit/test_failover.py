"""Moving a request to another scheduler mid-stream: the client's text continues exactly.

The real detokenizer service (its bus replaced by a recorder) and the gateway's tracker, fed
the outputs two schedulers would send: the first stops after k tokens, the second resumes
after them. Whatever k, the client's text equals an uninterrupted run's, also when k falls
inside a multi-byte character or while a possible stop string is held back, and late output
of the first scheduler never reaches the client.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from common.config import ServerArgs
from common.messages import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    Finish,
    GenerateReq,
    ReceiptOut,
    SamplingParams,
    StatsOut,
    TokenOut,
)
from common.peers import PeerTable
from common.subjects import Subjects
from services.detokenizer.server import DetokenizerService
from services.gateway import failover as failover_module
from services.gateway.failover import Failover
from services.gateway.tracker import Tracker

TEXT = "Café ☕ costs 3€. The answer is 42, said the waiter 🙂."
STOPS = ["The answer was"]  # "The answer" is held back until " is" shows it is no stop


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    async def publish(self, subject, msg, headers=None) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def detok(smol_path):
    service = DetokenizerService(ServerArgs(model=str(smol_path)))
    service.bus = Recorder()
    return service


def _item(rid: str, ids: list[int], first: bool = False, done: bool = False,
          prior: list[int] | None = None) -> TokenOut:
    return TokenOut(rid=rid, gateway_id="g", token_ids=ids, first=first,
                    stop=STOPS if first else None, prior_ids=prior,
                    finish=Finish(kind="length") if done else None)


def _client_text(detok: DetokenizerService, tracker: Tracker, batches) -> str:
    """Run batches through the detokenizer and the tracker; what the client is sent."""
    queue = tracker.subs[next(iter(tracker.subs))].queue
    text = ""
    for batch in batches:
        if isinstance(batch, AbortReq):
            asyncio.run(detok.on_abort(batch, {}))
        else:
            detok.bus.sent.clear()
            asyncio.run(detok.on_tokens(batch, {}))
            for out in detok.bus.sent:
                assert isinstance(out, BatchTextOut)
                for item in out.items:
                    tracker.deliver(item)
        while not queue.empty():
            text += queue.get_nowait().out.text
    return text


def _tracker(rid: str) -> Tracker:
    tracker = Tracker()
    msg = GenerateReq(rid=rid, gateway_id="g", params=SamplingParams(temperature=0.0),
                      text="prompt")
    tracker.add(msg, 0, asyncio.Queue())
    return tracker


def _uninterrupted(detok, ids) -> str:
    tracker = _tracker("whole")
    batches = [BatchTokenOut("A", [_item("whole", [t], first=i == 0,
                                         done=i == len(ids) - 1)])
               for i, t in enumerate(ids)]
    return _client_text(detok, tracker, batches)


def test_resumed_stream_continues_the_text_exactly_wherever_it_was_cut(detok):
    ids = detok.tokenizer.encode(TEXT).ids
    whole = _uninterrupted(detok, ids)
    assert whole == TEXT
    for k in range(1, len(ids) - 1):
        rid = f"moved-{k}"
        tracker = _tracker(rid)
        sub = tracker.subs[rid]
        tracker.accept(rid, "A")
        before = [BatchTokenOut("A", [_item(rid, [t], first=i == 0)])
                  for i, t in enumerate(ids[:k])]
        text = _client_text(detok, tracker, before)
        moved = tracker.move(sub, "B")
        new = moved.rid  # the resumed copy's own rid: nothing of the old copy matches it
        after = [
            AbortReq(rid=rid, reason="moved"),
            BatchTokenOut("B", [_item(new, [ids[k]], first=True, prior=ids[:k])]),
            BatchTokenOut("A", [_item(rid, [ids[k]])]),  # a late step of the one it left
            *[BatchTokenOut("B", [_item(new, [t], done=j == len(ids) - 1)])
              for j, t in enumerate(ids[k + 1:], start=k + 1)],
            # the old one (silent, not dead) got its abort: its last output ends its copy
            BatchTokenOut("A", [TokenOut(rid=rid, gateway_id="g", token_ids=[],
                                         finish=Finish(kind="abort", message="moved"))]),
        ]
        text += _client_text(detok, tracker, after)
        assert moved.output_ids == ids[:k] and moved.scheduler_id == "B"
        assert new == f"{rid}~1" and tracker.subs == {new: sub}
        assert text == whole, f"cut after {k} tokens"
        assert sub.delivered_ids == ids and sub.finish.kind == "length"
    assert not [key for key in detok.states if key[0].startswith("moved-")]


def test_abort_for_the_old_scheduler_drops_only_its_state(detok):
    ids = detok.tokenizer.encode("Hello there").ids
    asyncio.run(detok.on_tokens(BatchTokenOut("A", [_item("r", ids[:1], first=True)]), {}))
    asyncio.run(detok.on_tokens(BatchTokenOut("B", [_item("r", ids[1:], first=True,
                                                           prior=ids[:1])]), {}))
    assert {("r", "A"), ("r", "B")} <= set(detok.states)
    asyncio.run(detok.on_abort(AbortReq(rid="r", scheduler_id="A"), {}))
    assert ("r", "A") not in detok.states and ("r", "B") in detok.states
    asyncio.run(detok.on_abort(AbortReq(rid="r"), {}))
    assert detok.states[("r", "B")].aborted  # kept for the outputs still on their way


def test_an_aborted_request_streams_up_to_its_final_abort_without_a_gap(detok):
    """The scheduler sends a few more steps before it reads the abort: they decode in order
    (no 'lost output' that would resume the request), and the final one ends the stream."""
    ids = detok.tokenizer.encode("Hello there, how are you").ids
    tracker = _tracker("ab")
    sub = tracker.subs["ab"]
    gaps = []
    tracker.on_gap = gaps.append
    batches = [BatchTokenOut("A", [_item("ab", ids[:1], first=True)]),
               AbortReq(rid="ab", reason="aborted by request"),
               *[BatchTokenOut("A", [TokenOut(rid="ab", gateway_id="g", token_ids=[t],
                                              offset=i)]) for i, t in enumerate(ids[1:3], 1)],
               BatchTokenOut("A", [TokenOut(rid="ab", gateway_id="g", token_ids=[], offset=3,
                                            finish=Finish(kind="abort"))])]
    text = _client_text(detok, tracker, batches)
    assert not gaps and sub.finish.kind == "abort"
    assert text == detok.tokenizer.decode(ids[:3])
    assert ("ab", "A") not in detok.states


def test_an_aborted_request_no_scheduler_answers_for_is_swept_after_a_grace(detok):
    from services.detokenizer.server import ABORTED_GRACE_S

    now = time.monotonic()
    asyncio.run(detok.on_tokens(BatchTokenOut("A", [_item("gone", [5], first=True)]), {}))
    asyncio.run(detok.on_tokens(BatchTokenOut("A", [_item("live", [5], first=True)]), {}))
    asyncio.run(detok.on_abort(AbortReq(rid="gone"), {}))
    detok.sweep(now + ABORTED_GRACE_S + 1)
    assert ("gone", "A") not in detok.states and ("live", "A") in detok.states
    del detok.states[("live", "A")]


def test_tracker_learns_the_owner_on_acceptance_and_keeps_a_moved_request_there():
    tracker = _tracker("r")
    sub = tracker.subs["r"]
    tracker.accept("r", "A")
    tracker.accept("r", "C")  # a duplicate delivery elsewhere does not steal it
    assert tracker.owned_by("A") == [sub] and tracker.owned_by("C") == []
    msg = tracker.move(sub, "B")
    assert msg.scheduler_id == "B" and msg.output_ids == [] and sub.migrations == 1
    assert tracker.owned_by("A") == [] and tracker.owned_by("B") == [sub]


def test_a_message_lost_on_a_dead_nats_node_resumes_instead_of_leaving_a_gap(detok):
    """Each output says how many tokens came before it (`offset`). One batch between scheduler
    and detokenizer is lost: the detokenizer cannot go on, says so with the offset, the gateway
    drops it and resumes after what its client has; the client's text is the uninterrupted one."""
    ids = detok.tokenizer.encode(TEXT).ids
    whole = _uninterrupted(detok, ids)
    k = len(ids) // 2
    tracker = _tracker("r")
    sub = tracker.subs["r"]
    gaps: list[str] = []
    tracker.on_gap = lambda s: gaps.append(s.msg.rid)

    def item(rid: str, i: int, **kw) -> TokenOut:
        out = _item(rid, [ids[i]], done=i == len(ids) - 1, **kw)
        out.offset = i
        return out

    before = [BatchTokenOut("A", [item("r", i, first=i == 0)]) for i in range(k)]
    text = _client_text(detok, tracker, before)
    # the batch with token k is lost on the way to the detokenizer; the next one shows it
    text += _client_text(detok, tracker, [BatchTokenOut("A", [item("r", k + 1)])])
    assert gaps == ["r"] and sub.delivered_ids == ids[:k] and ("r", "A") not in detok.states
    moved = tracker.move(sub, "A")  # the same scheduler: only a message was lost
    after = [BatchTokenOut("A", [item("r", k + 2)]),  # the old copy, until its abort lands
             BatchTokenOut("A", [item(moved.rid, k, first=True, prior=ids[:k])]),
             *[BatchTokenOut("A", [item(moved.rid, i)]) for i in range(k + 1, len(ids))]]
    text += _client_text(detok, tracker, after)
    assert text == whole and sub.delivered_ids == ids and gaps == ["r"]


class FakeBus:
    """What the failover sends, and a connection that can be cut."""

    def __init__(self) -> None:
        self.connected = True
        self.sent: list = []

    async def publish(self, subject, msg, headers=None) -> None:
        self.sent.append(msg)

    async def publish_acked(self, subject, msg, headers=None, timeout=5.0) -> ReceiptOut:
        self.sent.append(msg)
        return ReceiptOut(service="tokenizer", instance_id="t1")


def _failover(tracker: Tracker) -> tuple[Failover, FakeBus, PeerTable]:
    bus, peers = FakeBus(), PeerTable(5.0)
    peers.record(StatsOut(service="scheduler", instance_id="A", time=0.0))
    return Failover(bus, Subjects(), peers, tracker, lambda: None, 2.0), bus, peers


async def _watch_for(failover: Failover, seconds: float) -> None:
    task = asyncio.ensure_future(failover.watch())
    await asyncio.sleep(seconds)
    task.cancel()


def test_a_request_silent_after_a_reconnect_resumes_once_after_what_its_client_has(
        monkeypatch):
    monkeypatch.setattr(failover_module, "RESUME_AFTER_S", 0.2)
    tracker = _tracker("r")
    sub = tracker.subs["r"]
    tracker.accept("r", "A")
    sub.delivered_ids = [5, 6, 7]
    failover, bus, _ = _failover(tracker)
    failover.on_connection(False)
    failover.on_connection(True)  # its last output may have been lost meanwhile
    asyncio.run(_watch_for(failover, 0.6))
    aborts = [m for m in bus.sent if isinstance(m, AbortReq)]
    resent = [m for m in bus.sent if isinstance(m, GenerateReq)]
    # once: the resumed copy is no suspect; the old one is stopped by its own rid
    assert [a.rid for a in aborts] == ["r"] and len(resent) == 1
    assert resent[0].rid == "r~1" and resent[0].output_ids == [5, 6, 7]
    assert resent[0].scheduler_id == "A"  # alive: its prefix is cached there
    assert failover.resumed == {"stalled": 1} and tracker.subs == {"r~1": sub}


def test_a_gateway_cut_off_longer_than_the_heartbeat_timeout_fails_its_requests():
    tracker = _tracker("r")
    failover, bus, _ = _failover(tracker)
    failover.timeout = 0.3
    bus.connected = False
    failover.on_connection(False)
    asyncio.run(_watch_for(failover, 0.6))
    event = tracker.subs["r"].queue.get_nowait()
    assert event.out.code == "nats_disconnected" and event.out.status == 503
    assert not [m for m in bus.sent if isinstance(m, GenerateReq)]
