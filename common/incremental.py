"""Incremental detokenization of one request, with stop strings held back and trimmed.

`tokenizers`' DecodeStream turns one token at a time into text and waits while a multi-byte
character is incomplete. On top of it we hold back any tail of the text that could be the
start of a stop string, so that stop text never reaches the client.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class IncrementalText:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str] | None,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stops = stops or []
        self.include_stop = include_stop
        self.text = ""  # everything decoded so far
        self.sent = 0  # how much of it the client has

    def push(self, token_ids: list[int]) -> None:
        for t in token_ids:
            piece = self.stream.step(self.tokenizer, t)
            if piece:
                self.text += piece

    def take(self, finished: bool, matched_stop: str | None) -> str:
        """The text that may go to the client now."""
        end = len(self.text)
        if matched_stop:
            at = self.text.find(matched_stop, max(0, self.sent - len(matched_stop) + 1))
            if at < 0:
                at = self.text.find(matched_stop)
            if at >= 0:
                end = at + len(matched_stop) if self.include_stop else at
        elif self.stops and not finished:
            end -= held_back(self.text[self.sent :], self.stops)
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out
