"""A request's text as its tokens come: incremental decoding with stop strings.

`tokenizers`' DecodeStream turns one token at a time into text and waits while a multi-byte
character is incomplete. The engine finds stop strings in this text the step they complete;
the detokenizer and the offline `Engine` take from it what may go out, holding back any tail
that could be the start of a stop string and trimming the one that matched. Every search
looks only past what was already searched or emitted: with `min_tokens`, an occurrence before
the minimum neither stops the request nor cuts its text later.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from common.messages import Finish


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def find_after(text: str, stop: str, start: int) -> int:
    """Where `stop` first occurs in `text` among the occurrences that end past `start`."""
    return text.find(stop, max(0, start - len(stop) + 1))


class IncrementalText:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str] | None,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        prior: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stops = stops or []
        self.include_stop = include_stop
        self.text = ""  # everything decoded so far
        self.sent = 0  # how much of it has gone out
        self.push(prior)

    def push(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            piece = self.stream.step(self.tokenizer, t)
            if piece:
                self.text += piece

    def match(self, since: int) -> str | None:
        """The first stop string (in the request's order) that completes past `since`."""
        return next((s for s in self.stops if find_after(self.text, s, since) >= 0), None)

    def take(self, finished: bool, matched_stop: str | None) -> str:
        """The text that may go out now."""
        end = len(self.text)
        if matched_stop:
            at = find_after(self.text, matched_stop, self.sent)
            if at < 0:  # cannot happen while both decodes agree; never leak the stop text
                at = self.text.find(matched_stop)
            if at >= 0:
                end = at + len(matched_stop) if self.include_stop else at
        elif self.stops and not finished:
            end -= held_back(self.text[self.sent :], self.stops)
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def take_output(self, finish: Finish | None) -> str:
        """`take` for an engine output that ends with `finish` (None: the request goes on)."""
        matched = finish.matched if finish is not None and finish.kind == "stop" else None
        return self.take(finish is not None, matched if isinstance(matched, str) else None)
