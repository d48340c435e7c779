"""Speculative decoding's first half: guess the next tokens of a request cheaply.

The seam beside the sampler. A proposer looks at a request's tokens and offers up to `k` that
may follow; the target model then scores all of them in one extend step over k + 1 positions,
and the sampler keeps the longest prefix it agrees with (the verification half, which lives
with the engine's step). A proposer never changes a request, and an empty guess is always
allowed: that request decodes one token as it would without speculation.

`NgramProposer` is prompt lookup (vLLM's `ngram`, SGLang's `NGRAM`): the last n tokens found
earlier in the request's own prompt or output, and what followed them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that may follow `tokens` (a request's prompt then output)."""
        ...


class NgramProposer:
    """The longest suffix of n tokens, n from `max_n` down to `min_n`, that occurred before in
    the same token list: propose the (up to k) tokens that followed its latest earlier match."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        # a scan back over the tokens: O(len(tokens)) a call, which a few thousand tokens per
        # request per step can afford; an index of the n-grams is the cure where it shows
        if k < 1:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = list(tokens[size - n:])
            # the latest earlier occurrence, ending before the suffix itself starts
            for start in range(size - n - 1, -1, -1):
                if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                    follow = tokens[start + n:start + n + k]
                    return list(follow)
        return []
