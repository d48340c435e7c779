"""Grammar-constrained decoding: compile a request's constraint, mask every token it samples.

    arrives ----> GrammarCompiler.submit    (a thread pool; cached by the constraint's text)
       |  WAITING_FOR_GRAMMAR: in no queue of the scheduler, so it holds back no one
       v  compiled; failed (a 400 naming the field); or slower than --grammar-compile-timeout
    a matcher of its own, fed the tokens it already has (a request moved from a dead scheduler)
       |  each step it samples: its row of the bitmask is filled and applied to its logits,
       v  the token drawn is accepted; a matcher that terminates ends the request (stop)

Only rows that sample are masked (a prefill chunk has no logits), and a retracted request keeps
its matcher: its accepted tokens are its output tokens, which retraction keeps too.

JSON is compact: the grammar allows no whitespace between tokens (xgrammar's
`any_whitespace=False`). With free whitespace a small model can fall into endless newlines
inside an object and never close it.

The backend sits behind `GrammarBackend` so another one (llguidance) can stand beside xgrammar.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from common.messages import GRAMMAR_COMPILE_BUCKETS, StructuredOutputs
from services.scheduler.core.closeout import JsonCloser

CACHE_ENTRIES = 512
COMPILE_THREADS = 2
QUEUE_WAIT_FACTOR = 3  # a compile not yet started fails after this many timeouts


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why, `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Matcher(Protocol):
    def accept(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(Protocol):
    name: str

    def prepare(self) -> None:
        """Read what compiling needs (the vocabulary), once; the compile threads call it before
        a compile's clock starts, so the first constraint's wait is not its compile time."""
    def compile(self, kind: str, text: str) -> Any:
        """Compile one constraint (`kind` as in `StructuredOutputs.kinds`); raises on error."""
    def matcher(self, compiled: Any) -> Matcher: ...
    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """Row `rows[i]` of the bitmask: the tokens `matchers[i]` allows next."""
    def fill_bitmask(self, matcher: Matcher, bitmask: torch.Tensor, row: int) -> None: ...
    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int]) -> None: ...
    def closer(self) -> JsonCloser | None:
        """What closes JSON within a request's budget (`closeout.py`), if the backend can: one
        per backend, built at the first call (from a compile thread: `GrammarCompiler`)."""


def constraint_text(so: StructuredOutputs) -> tuple[str, str]:
    """(kind, text) of a constraint with exactly one kind set; the text is the cache key."""
    kinds = so.kinds()
    if len(kinds) != 1:
        raise GrammarError(
            "give at most one constraint, not " + " and ".join(kinds) if kinds
            else "the structured output constraint is empty", so.param)
    kind = kinds[0]
    if kind == "json":
        value = so.json
        return kind, value if isinstance(value, str) else json.dumps(value)
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "choice":
        assert so.choice is not None
        if not so.choice or any(not isinstance(c, str) or not c for c in so.choice):
            raise GrammarError("choice must be a list of non-empty strings", so.param)
        # EBNF string literals take JSON's escapes
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in so.choice)
    value = getattr(so, kind)
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{kind} must be a non-empty string", so.param)
    return kind, value


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@functools.lru_cache(maxsize=4)
def _tokenizer_info(tokenizer_json: Path, mtime_ns: int, vocab_size: int,
                    stop_token_ids: tuple[int, ...]) -> tuple[Any, list[bytes]]:
    """xgrammar's view of a vocabulary, and its tokens' bytes, once a process (per file as it
    is now: `mtime_ns` is part of the key): reading them took 0.6 s of each engine's start
    with SmolLM2's 49,152 tokens, and both are read only."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    # vocab_size: the lm_head's rows, which may be more than the tokenizer's tokens
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids))
    return info, list(info.decoded_vocab)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        # Nothing is read until the first constraint (prepare): xgrammar's import and its view
        # of the vocabulary took 2-3 s of a scheduler's start with SmolLM2's 49,152 tokens, and
        # 10 s with Gemma 3's 262,144 (AVX2 EPYC), for servers that may never see a schema.
        self._source = (Path(tokenizer_json).resolve(), tuple(stop_token_ids))
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._prepared = False
        self._closer: JsonCloser | None = None

    def prepare(self) -> None:
        with self._lock:
            if self._prepared:
                return
            import xgrammar as xgr

            path, stops = self._source
            self.xgr = xgr
            self.info, self.decoded_vocab = _tokenizer_info(path, path.stat().st_mtime_ns,
                                                            self.vocab_size, stops)
            # our own cache (below) counts hits; xgrammar's would hide them
            self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
            self.batch = xgr.BatchGrammarMatcher(max_threads="auto")  # fills rows in parallel
            self._prepared = True

    def compile(self, kind: str, text: str) -> Any:
        self.prepare()
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(_CPP_PREFIX.sub("", str(exc)).strip()) from None

    def matcher(self, compiled: Any) -> Matcher:
        self.prepare()
        return _XGrammarMatcher(self.xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, rows)

    def fill_bitmask(self, matcher: Matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.m.fill_next_token_bitmask(bitmask, row)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        self.prepare()
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def closer(self) -> JsonCloser:
        self.prepare()
        with self._lock:
            if self._closer is None:
                self._closer = JsonCloser(self.decoded_vocab, self.info.special_token_ids,
                                          self.info.stop_token_ids[0])
            return self._closer


class _XGrammarMatcher:
    def __init__(self, m: Any) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last tokens accepted (speculative drafts that were only tried)."""
        if num_tokens:
            self.m.rollback(num_tokens)


@dataclass
class _Compile:
    """One constraint's compile, shared by every request that asks for it."""

    future: Future | None = None
    started: float | None = None  # time.monotonic() when a thread took it up


@dataclass
class GrammarJob:
    """A request's wait for its grammar."""

    compile: _Compile
    param: str | None
    submitted: float = 0.0  # time.monotonic()

    @property
    def future(self) -> Future:
        return self.compile.future


@dataclass
class GrammarStats:
    requests_total: int = 0  # requests that came with a constraint
    cache_hits_total: int = 0
    compile_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1))
    compile_seconds_sum: float = 0.0
    compile_count: int = 0

    def observe(self, seconds: float) -> None:
        self.compile_buckets[bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, seconds)] += 1
        self.compile_seconds_sum += seconds
        self.compile_count += 1


class GrammarCompiler:
    """Compiles constraints off the engine's thread, each text once (LRU of compiled ones)."""

    def __init__(self, backend: GrammarBackend, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS,
                                       thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self.stats = GrammarStats()
        self._lock = threading.Lock()  # compile threads observe stats
        self.ready_at: float | None = None  # when the backend had read its vocabulary

    def submit(self, so: StructuredOutputs) -> GrammarJob:
        """Start (or find) the compile of a request's constraint; raises GrammarError at once
        for a constraint that is malformed before it even reaches the backend."""
        self.stats.requests_total += 1
        key = constraint_text(so)
        entry = self.cache.get(key)
        if entry is not None:
            self.cache.move_to_end(key)
            self.stats.cache_hits_total += 1
        else:
            entry = _Compile()
            entry.future = self.pool.submit(self._compile, entry, *key)
            self.cache[key] = entry
            while len(self.cache) > CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return GrammarJob(entry, so.param, time.monotonic())

    def _compile(self, entry: _Compile, kind: str, text: str) -> Any:
        # the first constraint waits here while the backend reads the vocabulary: queued, not
        # compiling (timed_out bounds it as a queued compile). So does the first JSON one while
        # the JSON closer is built from the vocabulary (0.2 s with Gemma 3's 262,144 tokens),
        # here and not on the engine's thread, where every running request would wait for it.
        self.backend.prepare()
        if kind == "json":
            self.backend.closer()
        entry.started = time.monotonic()
        if self.ready_at is None:
            self.ready_at = entry.started
        t0 = time.perf_counter()
        try:
            return self.backend.compile(kind, text)
        finally:
            with self._lock:
                self.stats.observe(time.perf_counter() - t0)

    def timed_out(self, job: GrammarJob, now: float) -> bool:
        """Whether the compile has run longer than the timeout (time queued behind other
        compiles does not count: a burst of new schemas is not an error)."""
        if job.future.done() or self.ready_at is None:
            return False  # (or the backend is still reading its vocabulary: no schema's time)
        started = job.compile.started
        if started is not None:
            return now - started > self.timeout_s
        # queued behind compiles that may never end (a pathological schema holds its thread):
        # the wait is bounded too, more loosely
        return now - max(job.submitted, self.ready_at) > QUEUE_WAIT_FACTOR * self.timeout_s

    def matcher(self, job: GrammarJob) -> Matcher:
        """The compiled grammar's matcher (the job is done); raises GrammarError if it failed."""
        try:
            compiled = job.future.result()
        except ValueError as exc:
            raise GrammarError(f"invalid {job.param or 'constraint'}: {exc}", job.param) from None
        return self.backend.matcher(compiled)

    def timeout_error(self, job: GrammarJob) -> GrammarError:
        return GrammarError(
            f"{job.param or 'the constraint'}: compiling its grammar took longer than "
            f"{self.timeout_s:g} s (--grammar-compile-timeout)", job.param)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
