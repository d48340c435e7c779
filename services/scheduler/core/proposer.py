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
from typing import Any, Protocol


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], k: int, state: Any = None) -> list[int]:
        """Up to `k` tokens that may follow `tokens` (a request's prompt then output). `state`
        is what `new_state` gave for this request (kept on it between steps), or None."""
        ...

    def new_state(self) -> Any:
        """A request's own state for this proposer (None: it needs none)."""
        ...


class TokenView(Sequence[int]):
    """A request's prompt then output as one sequence, without copying either."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt = prompt
        self.output = output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, key):  # an int or a slice with step 1
        n = len(self.prompt)
        if isinstance(key, int):
            key = key + len(self) if key < 0 else key
            return self.prompt[key] if key < n else self.output[key - n]
        start, stop, _ = key.indices(len(self))
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n:stop - n]
        return self.prompt[start:] + self.output[:stop - n]


class NgramIndex:
    """One request's n-grams by their latest start, for n in [min_n, max_n], of those with a
    token after them; extended as the request's tokens grow (tokens only ever grow)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.size = 0
        self.starts: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def update(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self.size:  # not the same request's tokens: start over
            self.__init__(min(self.starts), max(self.starts))
        if len(tokens) == self.size:
            return
        # at size s the n-gram that starts at s - 1 - n has its follower, tokens[s - 1]
        window = tokens[max(0, self.size - max(self.starts) - 1):len(tokens)]
        offset = len(tokens) - len(window)
        for s in range(self.size + 1, len(tokens) + 1):
            for n, table in self.starts.items():
                start = s - 1 - n
                if start >= offset:
                    table[tuple(window[start - offset:s - 1 - offset])] = start
        self.size = len(tokens)

    def lookup(self, tokens: Sequence[int], k: int, per_match: int = 0) -> list[int]:
        """What followed the latest earlier match of the longest suffix that has one: up to k
        tokens, and with `per_match` > 0 up to n + per_match for a suffix of n."""
        size = len(tokens)
        for n in sorted(self.starts, reverse=True):
            if n > size - 1:
                continue
            start = self.starts[n].get(tuple(tokens[size - n:size]))
            if start is not None:
                take = min(k, n + per_match) if per_match > 0 else k
                return list(tokens[start + n:start + n + take])
        return []


class NgramProposer:
    """The longest suffix of n tokens, n from `max_n` down to `min_n`, that occurred before in
    the same token list: propose the (up to k) tokens that followed its latest earlier match.

    With `per_match` > 0, at most n + per_match of them: a long match (a passage being copied,
    a loop) earns many drafts, a short one (a single token seen before) few, so that a large
    k pays where drafts are accepted and costs little verify work where they are not."""

    def __init__(self, min_n: int = 2, max_n: int = 4, per_match: int = 0) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.per_match = per_match

    def new_state(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, tokens: Sequence[int], k: int, state: NgramIndex | None = None,
                ) -> list[int]:
        if k < 1:
            return []
        if state is not None:  # each step adds a few entries and looks up a few n-grams
            state.update(tokens)
            return state.lookup(tokens, k, self.per_match)
        return self._scan(tokens, k)

    def _scan(self, tokens: Sequence[int], k: int) -> list[int]:
        """Without an index: a scan back over the tokens, O(len(tokens)) a call."""
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = list(tokens[size - n:])
            # the latest earlier occurrence, ending before the suffix itself starts
            for start in range(size - n - 1, -1, -1):
                if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                    take = min(k, n + self.per_match) if self.per_match > 0 else k
                    return list(tokens[start + n:start + n + take])
        return []
