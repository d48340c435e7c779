"""JSON that always closes within its budget: a request constrained to JSON never lets the
tokens it has left fall below what the shortest way to finish its JSON costs.

    every step, once the budget is near (remaining <= 2 * last cost + WINDOW):
      the token drawn is tried on a fork of the matcher; if what closing would cost after it
      is more than the tokens left after it, the token is replaced by the first token of the
      closing from here, and the rest of the closing follows (then the stop token)

So by induction the closing always fits: it fits at the start (a budget that cannot hold the
smallest document is refused: 400 naming max_tokens), and every step either keeps it fitting
or starts writing it. A sampled reply is unconstrained until then; it never ends cut by the
budget with half a document. (Before the window the cost is measured only every REFRESH_STEPS
steps, so a closing that grew by more than the window in that many tokens, a schema of deep
required objects, could still outrun the budget and end with `length`; none of our thirty
test schemas comes near.)

The closing is found a character at a time on a fork of the matcher, as a JSON writer in a
hurry would: inside a string, close it; outside, close an object or an array, end a number, or
write the smallest value (`0`, `""`, `[]`, `{}`); where the grammar allows one way on only
(a required key, `: `, the rest of `true`), xgrammar's jump-forward string. Its characters are
then written in the fewest tokens of the vocabulary. It is an upper bound on the shortest
completion, tight for the schemas we know of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INSIDE = b'"'  # inside a string: close it
OUTSIDE = b'}],0"[{tf-n'  # outside: close, separate, then the smallest values
# where neither works (a pattern, an enum): any ASCII; and in the middle of a character (a
# token may end inside one), a UTF-8 continuation byte
FALLBACK = bytes(range(32, 127)) + bytes(range(0x80, 0xC0))
MAX_CLOSING_CHARS = 2048  # a grammar whose closing is longer gets no close-out
MAX_PIECE = 16  # the longest token tried when the closing is cut into tokens
WINDOW = 32  # checks start this many tokens (plus twice the last cost) before the end
REFRESH_STEPS = 8  # before the window, the cost is measured again this often


@dataclass
class CloseoutState:
    """One request's close-out: where its JSON text stands, and the closing once it began."""

    in_string: bool = False
    escape: bool = False
    last_cost: int = 0  # tokens the closing took when last measured
    since_check: int = 0
    forced: list[int] = field(default_factory=list)  # the rest of the closing being written

    def scan(self, data: bytes) -> None:
        for ch in data:
            if self.escape:
                self.escape = False
            elif self.in_string and ch == 0x5C:  # backslash
                self.escape = True
            elif ch == 0x22:  # quote
                self.in_string = not self.in_string


class JsonCloser:
    """The closing of JSON constrained by a matcher, in tokens of one vocabulary."""

    def __init__(self, decoded_vocab: list[bytes], special_ids: list[int],
                 stop_id: int) -> None:
        self.vocab = decoded_vocab
        self.stop_id = stop_id
        special = set(special_ids)
        self.by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(decoded_vocab):
            if 0 < len(b) <= MAX_PIECE and i not in special:
                self.by_bytes.setdefault(b, i)

    def start(self, matcher: Any, output_ids: list[int]) -> CloseoutState | None:
        """A request's state after the tokens it already has; None if its grammar cannot be
        closed this way."""
        state = CloseoutState()
        for t in output_ids:
            state.scan(self.vocab[t])
        path = self.closing(matcher, state)
        if path is None:
            return None
        state.last_cost = len(path)
        return state

    def closing(self, matcher: Any, state: CloseoutState) -> list[int] | None:
        """The tokens that finish the document from the matcher's state, the stop token last."""
        if matcher.is_terminated():
            return []
        text = self._closing_text(matcher.fork(), state.in_string, state.escape)
        return None if text is None else self.tokens(text) + [self.stop_id]

    def _closing_text(self, m: Any, in_string: bool, escape: bool) -> bytes | None:
        lex = CloseoutState(in_string=in_string, escape=escape)
        out = bytearray()
        while not m.is_completed():
            if len(out) > MAX_CLOSING_CHARS:
                return None
            step = self._next_piece(m, lex.in_string)
            if step is None:
                return None
            out += step
            lex.scan(step)
        return bytes(out)

    @staticmethod
    def _next_piece(m: Any, in_string: bool) -> bytes | None:
        """Take the next piece of the closing on `m`: a preferred character, else the only way
        on, else any character the grammar takes."""
        for ch in INSIDE if in_string else OUTSIDE:
            if m.accept_string(bytes([ch])):
                return bytes([ch])
        forward = m.find_jump_forward_string().encode()
        if forward and m.accept_string(forward):
            return forward
        for ch in FALLBACK:
            if m.accept_string(bytes([ch])):
                return bytes([ch])
        return None

    def tokens(self, text: bytes) -> list[int]:
        """`text` in the fewest tokens (every single byte is a token of a byte-level BPE)."""
        n = len(text)
        best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n  # (count, start of last)
        for end in range(1, n + 1):
            for start in range(max(0, end - MAX_PIECE), end):
                if text[start:end] in self.by_bytes and best[start][0] + 1 < best[end][0]:
                    best[end] = (best[start][0] + 1, start)
        out, end = [], n
        while end > 0:
            start = best[end][1]
            out.append(self.by_bytes[text[start:end]])
            end = start
        return out[::-1]

    def choose(self, matcher: Any, state: CloseoutState, token: int, remaining: int) -> int:
        """The token to write instead of the one drawn (`remaining`: tokens the request may
        still write, this one included): the drawn one while the closing still fits after it,
        else the next token of the closing."""
        if state.forced:
            return state.forced.pop(0)
        if not self._due(state, remaining):
            return token
        after = matcher.fork()
        if not after.accept_token(token):
            return token  # not the grammar's: the engine's own check ends the request
        path = self.closing(after, self._after(state, token))
        if path is None or len(path) <= remaining - 1:
            state.last_cost = len(path or [])
            return token
        path = self.closing(matcher, state) or [token]
        state.forced = path[1:]
        return path[0]

    def _due(self, state: CloseoutState, remaining: int) -> bool:
        """Whether this step must check (near the end), or refresh the cost measured."""
        state.since_check += 1
        if remaining > 2 * state.last_cost + WINDOW and state.since_check < REFRESH_STEPS:
            return False
        state.since_check = 0
        return True

    def _after(self, state: CloseoutState, token: int) -> CloseoutState:
        nxt = CloseoutState(in_string=state.in_string, escape=state.escape)
        nxt.scan(self.vocab[token])
        return nxt

    def push(self, state: CloseoutState, token: int) -> None:
        """The request wrote `token`."""
        state.scan(self.vocab[token])
