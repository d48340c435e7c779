"""Moving a request to another scheduler mid-stream: the client's text continues exactly.

The real detokenizer service (its bus replaced by a recorder) and the gateway's tracker, fed
the outputs two schedulers would send: the first stops after k tokens, the second resumes
after them. Whatever k, the client's text equals an uninterrupted run's, also when k falls
inside a multi-byte character or while a possible stop string is held back, and late output
of the first scheduler never reaches the client.
"""

from __future__ import annotations

import asyncio

import pytest

from common.config import ServerArgs
from common.messages import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    Finish,
    GenerateReq,
    SamplingParams,
    TokenOut,
)
from services.detokenizer.server import DetokenizerService
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
        after = [
            AbortReq(rid=rid, scheduler_id="A", reason="moved"),
            BatchTokenOut("B", [_item(rid, [ids[k]], first=True, prior=ids[:k])]),
            BatchTokenOut("A", [_item(rid, [ids[k]])]),  # a late step of the one it left
            *[BatchTokenOut("B", [_item(rid, [t], done=j == len(ids) - 1)])
              for j, t in enumerate(ids[k + 1:], start=k + 1)],
            # the old one (silent, not dead) got its abort: its last output ends its copy
            BatchTokenOut("A", [TokenOut(rid=rid, gateway_id="g", token_ids=[],
                                         finish=Finish(kind="abort", message="moved"))]),
        ]
        text += _client_text(detok, tracker, after)
        assert moved.output_ids == ids[:k] and moved.scheduler_id == "B"
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
    assert not [k for k in detok.states if k[0] == "r"]


def test_tracker_learns_the_owner_on_acceptance_and_keeps_a_moved_request_there():
    tracker = _tracker("r")
    sub = tracker.subs["r"]
    tracker.accept("r", "A")
    tracker.accept("r", "C")  # a duplicate delivery elsewhere does not steal it
    assert tracker.owned_by("A") == [sub] and tracker.owned_by("C") == []
    msg = tracker.move(sub, "B")
    assert msg.scheduler_id == "B" and msg.output_ids == [] and sub.migrations == 1
    assert tracker.owned_by("A") == [] and tracker.owned_by("B") == [sub]
