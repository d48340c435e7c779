"""The engine core: scheduler + KV pool + model runner + sampler, one `step()` at a time.

No NATS, no HTTP. The scheduler service feeds it from the bus and runs `step()` in a worker
thread; the offline `Engine` and the benchmarks drive it directly. `submit` and `abort` may be
called from any thread: they only queue, and `step()` applies them at the step boundary.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import ServerArgs
from common.incremental import IncrementalText
from common.logging import get_logger
from common.messages import AbortReq, Finish, KvEvent, LogprobOut, TokenizedReq, TokenOut
from common.modelstore import gguf_source, model_info, prepare_model
from services.scheduler.core.closeout import JsonCloser
from services.scheduler.core.draft import draft_proposer, self_draft_proposer
from services.scheduler.core.grammar import GrammarCompiler, GrammarError, XGrammarBackend
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.lora_admin import LoraAdmin, LoraReply
from services.scheduler.core.request import Request
from services.scheduler.core.sampler import SampleRow, needs_counts, sample
from services.scheduler.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from services.scheduler.core.speculative import Speculator, accepted_prefix, spec_config
from services.scheduler.executor.model_runner import ModelRunner

log = get_logger("engine")

TOMBSTONE_S = 60.0
GRAMMAR_POLL_S = 0.005  # an idle step waits this long for a compile before it returns


@dataclass
class StepStats:
    step: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    scheduled_rids: list[str] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens computed, per scheduled_rids
    retracted_rids: list[str] = field(default_factory=list)
    forward_s: float = 0.0
    sample_s: float = 0.0
    mask_s: float = 0.0  # of sample_s: filling and applying grammar bitmasks
    num_masked: int = 0  # rows masked by a grammar
    num_draft_tokens: int = 0  # speculative drafts verified this step
    num_accepted_tokens: int = 0  # of them, accepted


class EngineCore:
    def __init__(self, args: ServerArgs, model_path: Path | None = None) -> None:
        self.args = args
        path = model_path or prepare_model(args.model, args.cache_dir)
        gguf = gguf_source(args.model) if model_path is None else None
        self.info = model_info(path, args.served_model_name, args.model, args.chat_template)
        self.runner = ModelRunner(
            path,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            cpu_memory_gib=args.cpu_memory_gib,
            max_model_len=args.max_model_len,
            num_threads=args.num_threads,
            quantization=args.quantization,
            gguf_path=gguf,
        )
        self.loras = LoraAdmin(self.runner, args, self.info.name)
        self.max_model_len = self.runner.max_model_len
        self.pool = BlockPool(self.runner.num_blocks, args.page_size, not args.disable_prefix_cache)
        self.loras.forget_cached = self.pool.forget
        self.scheduler = Scheduler(scheduler_config(args, self.max_model_len), self.pool)
        self.spec = self._speculator(args, path, gguf)
        self.eos_ids = set(self.info.eos_token_ids)
        self.grammars = GrammarCompiler(
            XGrammarBackend(self.info.tokenizer_json, self.runner.vocab_size,
                            sorted(self.eos_ids)),
            args.grammar_compile_timeout)
        self.compiling: list[Request] = []  # WAITING_FOR_GRAMMAR, in arrival order
        self._tokenizer = None
        self.requests: dict[str, Request] = {}
        self.tombstones: dict[str, float] = {}
        self._inbox: deque[TokenizedReq | AbortReq] = deque()
        self._lock = threading.Lock()
        self.num_steps = 0
        self.num_aborted_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step = StepStats()

    def _speculator(self, args: ServerArgs, path: Path,
                    gguf: Path | None) -> Speculator | None:
        """The flags' speculative decoding with its proposer (None: off)."""
        spec = spec_config(args)
        if spec is None:
            return None
        draft = None
        if spec.algorithm == "STANDALONE":
            draft = draft_proposer(args, self.runner, self.info.tokenizer_json,
                                   self.max_model_len)
        elif spec.algorithm == "SELF":
            draft = self_draft_proposer(args, self.runner, path, gguf, self.max_model_len)
        speculator = Speculator(spec, self.max_model_len, draft)
        log.info(f"speculative decoding: {spec.algorithm}, {spec.num_draft_tokens} draft "
                 f"tokens a step, off above {spec.disable_by_batch_size} running requests",
                 **speculator.info())
        return speculator

    # -- thread-safe entry points ---------------------------------------------------------------
    def submit(self, msg: TokenizedReq) -> None:
        with self._lock:
            self._inbox.append(msg)

    def abort(self, msg: AbortReq) -> None:
        with self._lock:
            self._inbox.append(msg)

    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self.compiling) or self.scheduler.has_work()

    def num_queued(self) -> int:
        """What waits: requests not yet scheduled, and the inbox no step has read yet."""
        return len(self.scheduler.waiting) + len(self._inbox)

    def fail_all(self, message: str) -> list[TokenOut]:
        """After an unexpected failure, end every request with an error, freeing its blocks."""
        outs = []
        for req in list(self.requests.values()):
            if not req.is_finished:
                self.scheduler.finish(req, Finish(kind="error", message=message, status=500))
            outs.append(self._finish_out(req))
        return outs

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.info.tokenizer_json))
        return self._tokenizer

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        outputs: list[TokenOut] = []
        self._drain_inbox(outputs)
        self._poll_grammars(outputs)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        for req in batch.failed:
            outputs.append(self._finish_out(req))
        if batch.retracted:
            log.warning(f"KV cache pool is full. Retracted {len(batch.retracted)} requests",
                        rids=[r.rid for r in batch.retracted])
            for req in batch.retracted if self.spec is not None else ():
                self.spec.release(req)  # a draft model's KV too: it recomputes it with the rest
        if batch.reqs:
            self._run(batch, outputs)
        elif batch.retracted:  # nothing ran, but who was retracted is news all the same
            self.last_step = StepStats(step=self.num_steps,
                                       retracted_rids=[r.rid for r in batch.retracted])
        elif self.compiling and not outputs:  # only compiles to wait for: do not spin
            wait_futures([r.grammar_job.future for r in self.compiling],
                         timeout=GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)
        if self.loras.enabled:
            self._count_loras()
        if self.args.debug_check_integrity and not self.scheduler.has_work() \
                and not self.compiling:
            self.check_integrity()
        return outputs

    def _drain_inbox(self, outputs: list[TokenOut]) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        now = time.monotonic()
        for msg in items:
            if isinstance(msg, AbortReq):
                self._apply_abort(msg, outputs, now)
            else:
                self._add(msg, outputs, now)
        if self.tombstones:
            self.tombstones = {r: t for r, t in self.tombstones.items() if t > now}

    def _add(self, msg: TokenizedReq, outputs: list[TokenOut], now: float) -> None:
        if msg.rid in self.requests:
            return  # a duplicate delivery
        req = Request.from_msg(msg)
        req.arrival_time = now
        if self.tombstones.pop(msg.rid, None) is not None:
            # Aborted before it got here: nothing is allocated, but its end is still reported,
            # so the service forgets what it kept for it and its trace says it was aborted.
            self.num_aborted_total += 1
            refusal = Finish(kind="abort", message="aborted before scheduling", status=499)
        elif (error := self._validate(req)) is not None:
            refusal = Finish(kind="error", message=error, status=400)
        else:
            self._admit(req, outputs)
            return
        self.scheduler.finish(req, refusal)
        outputs.append(self._finish_out(req))

    def _admit(self, req: Request, outputs: list[TokenOut]) -> None:
        """Give the request its per-request state and queue it."""
        self.requests[req.rid] = req
        if needs_counts(req.params):
            self._init_penalty_state(req)
        if req.params.stop:
            req.stop_text = IncrementalText(self.tokenizer, req.params.stop,
                                            req.params.skip_special_tokens,
                                            prior=req.output_ids)
        self.prompt_tokens_total += len(req.prompt_ids)
        if req.params.structured_outputs is not None:
            try:
                req.grammar_job = self.grammars.submit(req.params.structured_outputs)
            except GrammarError as exc:
                self._fail_grammar(req, exc, outputs)
                return
            self.scheduler.hold(req)
            self.compiling.append(req)
            return
        self.scheduler.add(req)

    def _poll_grammars(self, outputs: list[TokenOut]) -> None:
        """Queue the requests whose grammar is ready (with a matcher each); fail the others
        whose grammar failed or is late. The rest wait, out of everyone's way."""
        if not self.compiling:
            return
        now = time.monotonic()
        still = []
        for req in self.compiling:
            job = req.grammar_job
            if req.is_finished:  # aborted while it waited
                continue
            if not job.future.done():
                if self.grammars.timed_out(job, now):
                    self._fail_grammar(req, self.grammars.timeout_error(job), outputs)
                else:
                    still.append(req)
                continue
            try:
                req.matcher = self.grammars.matcher(job)
            except GrammarError as exc:
                self._fail_grammar(req, exc, outputs)
                continue
            # moved from another scheduler: the matcher takes the tokens the client already has
            if not all(req.matcher.accept(t) for t in req.output_ids):
                self._fail_grammar(req, GrammarError(
                    "the tokens this request resumed after do not fit its grammar",
                    job.param), outputs)
                continue
            req.grammar_job = None
            if self._start_closeout(req, outputs):
                self.scheduler.add(req)
        self.compiling = still

    @functools.cached_property
    def closer(self) -> JsonCloser | None:
        """What closes JSON within a request's budget: the backend's, which the compile thread
        built before the first JSON constraint's compile (the backend reads its vocabulary
        then, not at start)."""
        return self.grammars.backend.closer()

    def _start_closeout(self, req: Request, outputs: list[TokenOut]) -> bool:
        """Give a JSON request its close-out (`closeout.py`); False if its budget cannot hold
        the shortest document its schema allows (the request ends with a 400)."""
        kinds = req.params.structured_outputs.kinds()
        if kinds[0] not in ("json", "json_object") or self.closer is None:
            return True
        req.closeout = self.closer.start(req.matcher.m, req.output_ids)
        if req.closeout is None or req.closeout.last_cost <= self._remaining(req):
            return True
        self.scheduler.finish(req, Finish(
            kind="error", status=400, param="max_tokens",
            message=f"max_tokens: {self._remaining(req)} tokens cannot hold the shortest JSON "
                    f"the schema allows ({req.closeout.last_cost} tokens with the end token)"))
        outputs.append(self._finish_out(req))
        return False

    def _remaining(self, req: Request) -> int:
        """Tokens the request may still write (max_tokens, and what the context leaves)."""
        left = self.max_model_len - req.num_tokens
        if req.params.max_new_tokens is not None:
            left = min(left, req.params.max_new_tokens - req.num_generated)
        return left

    def _within_budget(self, req: Request, token: int) -> int:
        """The token drawn, or the closing's next one where the drawn one would leave the JSON
        too little budget to close."""
        if req.closeout is None:
            return token
        return self.closer.choose(req.matcher.m, req.closeout, token, self._remaining(req))

    def _fail_grammar(self, req: Request, exc: GrammarError, outputs: list[TokenOut]) -> None:
        self.scheduler.finish(req, Finish(kind="error", message=str(exc), status=400,
                                          param=exc.param))
        outputs.append(self._finish_out(req))

    def _validate(self, req: Request) -> str | None:
        if not req.prompt_ids:
            return "the prompt is empty"
        if req.num_tokens >= self.max_model_len:
            return (f"the prompt has {req.num_tokens} tokens; this model's context length is "
                    f"{self.max_model_len}")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.runner.vocab_size})"
        return self.loras.refusal(req.lora_name)

    def _apply_abort(self, msg: AbortReq, outputs: list[TokenOut], now: float) -> None:
        if msg.abort_all:
            victims = [r for r in self.requests.values() if not r.is_finished]
        elif msg.rid in self.requests:
            victims = [self.requests[msg.rid]]
        else:
            if msg.rid:
                self.tombstones[msg.rid] = now + TOMBSTONE_S
            victims = []
        for req in victims:
            if req.is_finished:
                continue
            self.scheduler.finish(req, Finish(kind="abort", message=msg.reason, status=499))
            self.num_aborted_total += 1
            outputs.append(self._finish_out(req))

    def _run(self, batch: ScheduledBatch, outputs: list[TokenOut]) -> None:
        t0 = time.perf_counter()
        # a request samples once every token it has is computed (a prefill's last chunk, a
        # decode), on 1 + m rows when it verifies m drafts
        samples = [1 + len(r.draft_ids) if r.num_computed + n == r.num_tokens + len(r.draft_ids)
                   else 0 for r, n in zip(batch.reqs, batch.num_new, strict=True)]
        num_logits = list(samples)
        prompt_rows = self._prompt_logit_rows(batch, num_logits)
        logits = self.runner.forward(batch.reqs, batch.num_new, num_logits)
        if prompt_rows:
            logits = self._take_prompt_logprobs(batch, num_logits, prompt_rows, logits)
        t1 = time.perf_counter()
        stats = self._step_stats(batch, t1 - t0)
        self.scheduler.advance(batch)
        self.num_steps += 1
        sampling = [(r, c) for r, c in zip(batch.reqs, samples, strict=True) if c]
        sampling, logits = self._end_unsampled(sampling, logits)
        if sampling:
            self._sample(logits, sampling, stats)
        stats.sample_s = time.perf_counter() - t1
        self.last_step = stats
        for req in batch.reqs:
            if req.first_scheduled_time is not None and not req.is_finished:
                out = self._progress_out(req)
                if out is not None:
                    outputs.append(out)
            elif req.is_finished:
                outputs.append(self._finish_out(req))

    # -- prompt logprobs (a request that asks: vLLM's prompt_logprobs, OpenAI's echo) ---------
    @staticmethod
    def _prompt_logit_rows(batch: ScheduledBatch, num_logits: list[int]) -> set[int]:
        """The batch rows whose request collects prompt logprobs: they take logits for every
        row of their chunk (set in num_logits); the last one is the sampling row as before."""
        rows = {i for i, r in enumerate(batch.reqs)
                if r.prompt_logprobs is not None and r.collects_prompt_logprobs}
        for i in rows:
            num_logits[i] = batch.num_new[i]
        return rows

    def _take_prompt_logprobs(self, batch: ScheduledBatch, num_logits: list[int],
                              prompt_rows: set[int], logits: torch.Tensor) -> torch.Tensor:
        """Turn the chunks' rows into prompt logprobs; returns the sampling rows alone."""
        keep, off = [], 0
        for i, (req, n) in enumerate(zip(batch.reqs, num_logits, strict=True)):
            if i in prompt_rows:
                prompt_logprobs(req, req.num_computed, logits[off:off + n])
                if req.num_computed + n == req.num_tokens:  # it samples: its last row
                    keep.append(off + n - 1)
            elif n:  # a sampling row, or a verify's 1 + m
                keep.extend(range(off, off + n))
            off += n
        return logits[keep]

    def _end_unsampled(self, sampling: list[tuple[Request, int]], logits: torch.Tensor,
                       ) -> tuple[list[tuple[Request, int]], torch.Tensor]:
        """A request with max_tokens 0 (echo, or its prompt's logprobs alone) ends with its
        prefill, `length` and no token; returns the requests that sample, and their rows."""
        if all(r.params.max_new_tokens != 0 for r, _ in sampling):
            return sampling, logits
        kept, rows, off = [], [], 0
        for req, count in sampling:
            if req.params.max_new_tokens == 0:
                self.scheduler.finish(req, Finish(kind="length"))
            else:
                kept.append((req, count))
                rows.extend(range(off, off + count))
            off += count
        return kept, logits[rows]

    def _step_stats(self, batch: ScheduledBatch, forward_s: float) -> StepStats:
        real = [n - len(r.draft_ids) for r, n in zip(batch.reqs, batch.num_new, strict=True)]
        return StepStats(
            step=self.num_steps + 1,
            num_tokens=batch.num_tokens,
            num_decode=sum(1 for n in real if n == 1),
            num_prefill_tokens=sum(n for n in real if n > 1),
            num_draft_tokens=batch.num_tokens - sum(real),
            scheduled_rids=[r.rid for r in batch.reqs],
            num_new=list(batch.num_new),
            retracted_rids=[r.rid for r in batch.retracted],
            forward_s=forward_s,
        )

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[Request, int]],
                stats: StepStats) -> None:
        """Sample every row, then give each request its tokens: the drafts its samples agree
        with and the sample after them (speculative.py says why that is exact)."""
        rows = [self._sample_row(r, j) for r, c in sampling for j in range(c)]
        blocked = self._apply_grammars(logits, sampling, stats)
        tokens, logprobs = sample(logits, rows)
        start = 0
        for req, count in sampling:
            drafts = req.draft_ids
            accepted = accepted_prefix(drafts, tokens[start:start + count])
            if drafts:
                self.scheduler.accept_drafts(req, accepted)
                self.spec.record(len(drafts), accepted)
                stats.num_accepted_tokens += accepted
            for j in range(accepted + 1):
                row = start + j
                if row in blocked:
                    self.scheduler.finish(req, Finish(
                        kind="error", status=400, param=req.params.structured_outputs.param,
                        message="the grammar allows no next token: the output cannot go on "
                                "within the constraint"))
                    break
                token, lp = tokens[row], logprobs[row] if logprobs else None
                if (chosen := self._within_budget(req, token)) != token:
                    # the JSON's closing instead (forced: probability 1); drafts after this
                    # row were verified against the token it replaces, so their KV goes
                    if j < accepted:
                        self.scheduler.unaccept_drafts(req, accepted - j)
                    self._append_token(req, chosen, lp and LogprobOut(chosen, 0.0))
                    break
                self._append_token(req, token, lp)
                if req.is_finished:
                    break  # a stop inside the drafts: what follows it is not output
            start += count

    def _apply_grammars(self, logits: torch.Tensor, sampling: list[tuple[Request, int]],
                        stats: StepStats) -> set[int]:
        """Mask the logits of the rows whose request has a grammar (in place); returns the rows
        whose grammar allows no token at all. A verifying request's row j is masked as its
        matcher stands after its first j drafts (tried, then rolled back)."""
        matchers, firsts, spec, row = [], [], [], 0
        for req, count in sampling:
            if req.matcher is not None:
                matchers.append(req.matcher)
                firsts.append(row)
                if count > 1:
                    spec.append((req, row))
            row += count
        if not firsts:
            return set()
        t0 = time.perf_counter()
        backend = self.grammars.backend
        bitmask = backend.allocate_bitmask(row)
        backend.fill_bitmasks(matchers, bitmask, firsts)
        masked = list(firsts)
        for req, first in spec:
            for j, token in enumerate(req.draft_ids, start=1):
                req.matcher.accept(token)  # speculator.grammar_prefix kept only allowed ones
                backend.fill_bitmask(req.matcher, bitmask, first + j)
                masked.append(first + j)
            req.matcher.rollback(len(req.draft_ids))
        backend.apply_bitmask(logits, bitmask, masked)
        blocked = {i for i in masked if not bool(bitmask[i].any())}
        stats.mask_s = time.perf_counter() - t0
        stats.num_masked = len(masked)
        return blocked

    def _sample_row(self, req: Request, draft: int = 0) -> SampleRow:
        """The request's sampler for its next token, or (draft j) for the token after its
        first j drafts, as if they had been accepted."""
        p = req.params
        suppress: list[int] = []
        if req.num_generated + draft < p.min_new_tokens:
            suppress = sorted((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids))
        return SampleRow(
            params=p,
            seed=req.seed,
            position=req.num_tokens + draft,
            output_counts=req.output_counts,
            seen_mask=req.seen_mask,
            suppress=suppress,
        )

    def _init_penalty_state(self, req: Request) -> None:
        dev = self.runner.device
        counts = torch.zeros(self.runner.vocab_size, device=dev)
        seen = torch.zeros(self.runner.vocab_size, dtype=torch.bool, device=dev)
        seen[torch.tensor(req.prompt_ids, device=dev)] = True
        for t in req.output_ids:
            counts[t] += 1
            seen[t] = True
        req.output_counts = counts
        req.seen_mask = seen

    def _append_token(self, req: Request, token: int, logprob: LogprobOut | None) -> None:
        req.output_ids.append(token)
        self.generation_tokens_total += 1
        if logprob is not None:
            req.pending_logprobs.append(logprob)
        if req.output_counts is not None:
            req.output_counts[token] += 1
            req.seen_mask[token] = True
        finish = self._check_grammar(req, token) or self._check_stop(req, token)
        if finish is not None:
            self.scheduler.finish(req, finish)

    def _check_grammar(self, req: Request, token: int) -> Finish | None:
        """The matcher takes the token; one it refuses (a ban overrode the mask) is an error,
        and a matcher that terminated (it took a stop token) ends the request."""
        if req.matcher is None:
            return None
        if not req.matcher.accept(token):
            return Finish(kind="error", status=400, param=req.params.structured_outputs.param,
                          message=f"token {token} does not fit the grammar (a ban such as "
                                  "min_tokens removed every token the grammar allows)")
        if req.closeout is not None:
            self.closer.push(req.closeout, token)
        if req.matcher.is_terminated():
            return Finish(kind="stop", matched=token if token in req.params.stop_token_ids
                          else None)
        return None

    def _check_stop(self, req: Request, token: int) -> Finish | None:
        p = req.params
        past_min = req.num_generated >= p.min_new_tokens
        if past_min and token in p.stop_token_ids:
            return Finish(kind="stop", matched=token)
        if past_min and not p.ignore_eos and token in self.eos_ids:
            return Finish(kind="stop")
        if req.stop_text is not None:
            before = len(req.stop_text.text)
            req.stop_text.push([token])
            if past_min and (matched := req.stop_text.match(before)) is not None:
                return Finish(kind="stop", matched=matched)
        limit = p.max_new_tokens if p.max_new_tokens is not None else self.max_model_len
        if req.num_generated >= limit or req.num_tokens >= self.max_model_len:
            return Finish(kind="length")
        return None

    # -- outputs --------------------------------------------------------------------------------
    def _progress_out(self, req: Request) -> TokenOut | None:
        new = req.output_ids[req.num_reported :]
        if not new:
            return None
        return self._make_out(req, new)

    def _finish_out(self, req: Request) -> TokenOut:
        out = self._make_out(req, req.output_ids[req.num_reported :])
        self._forget(req)
        return out

    def _make_out(self, req: Request, new: list[int]) -> TokenOut:
        out = TokenOut(
            rid=req.rid,
            gateway_id=req.gateway_id,
            token_ids=list(new),
            finish=req.finish,
            offset=req.num_reported,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=req.num_generated,
            cached_tokens=req.num_cached,
            logprobs=req.pending_logprobs or None,
            retractions=req.num_retractions,
        )
        if not req.reported_first:
            out.first = True
            out.stop = req.params.stop or None
            out.skip_special_tokens = req.params.skip_special_tokens
            out.include_stop_str_in_output = req.params.include_stop_str_in_output
            if req.first_scheduled_time is not None:
                out.queue_time = req.first_scheduled_time - req.arrival_time
            if req.initial_outputs:  # resumed: the detokenizer needs the left context
                out.prior_ids = req.output_ids[: req.initial_outputs]
            req.reported_first = True
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent \
                and not req.collects_prompt_logprobs:
            out.prompt_logprobs = req.prompt_logprobs
            req.prompt_logprobs_sent = True
        req.num_reported = req.num_generated
        req.pending_logprobs = []
        return out

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.rid, None)
        if self.spec is not None:
            self.spec.release(req)
        req.output_counts = req.seen_mask = req.stop_text = None

    # -- books ----------------------------------------------------------------------------------
    # -- LoRA adapters at runtime (called between steps, on the engine's thread) ---------------
    def load_lora(self, name: str, path: str) -> LoraReply:
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> LoraReply:
        """Drained: running and queued requests under it finish first (see lora_admin.py)."""
        return self.loras.unload(name, (r.lora_name for r in self.requests.values()))

    def _count_loras(self) -> None:
        """After a step: drop drained adapters no request uses; count requests per adapter."""
        if self.loras.draining:
            for name in self.loras.drop_drained({r.lora_name for r in self.requests.values()}):
                log.info(f"LoRA adapter {name!r} unloaded: its last request ended")
        self.loras.count((r.lora_name for r in self.scheduler.running),
                         (r.lora_name for r in self.scheduler.waiting))

    def flush_cache(self) -> tuple[bool, str]:
        if self.scheduler.has_work():
            return False, "cannot flush the cache while requests are running"
        n = self.pool.flush()
        return True, f"flushed {n} cached blocks"

    def enable_kv_events(self) -> None:
        self.pool.record_events()

    def take_kv_events(self) -> list[KvEvent]:
        """What entered and left the prefix cache since the last call (between steps only)."""
        return self.pool.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.pool.block_of)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if not self.scheduler.has_work() and not self.compiling:
            assert not self.requests, f"requests left in the table: {list(self.requests)[:5]}"
            if self.spec is not None:
                self.spec.check_integrity()

    def stats(self) -> dict:
        pool = self.pool
        return dict(
            in_flight=len(self.requests),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_total_blocks=pool.num_blocks,
            kv_free_blocks=pool.num_free,
            kv_cached_blocks=pool.num_cached,
            kv_usage=pool.usage(),
            num_retractions_total=self.scheduler.num_retractions_total,
            num_aborted_total=self.num_aborted_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=self.scheduler.prefix_queries_total,
            prefix_cache_hits_total=self.scheduler.prefix_hits_total,
            routed_predicted_tokens_total=self.scheduler.routed_predicted_total,
            routed_cached_tokens_total=self.scheduler.routed_cached_total,
            num_steps_total=self.num_steps,
            grammar_requests_total=self.grammars.stats.requests_total,
            grammar_cache_hits_total=self.grammars.stats.cache_hits_total,
            grammar_compile_buckets=list(self.grammars.stats.compile_buckets),
            grammar_compile_seconds_sum=self.grammars.stats.compile_seconds_sum,
            **self._spec_stats(),
            **self.loras.stats(),
        )

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        s = self.spec.stats
        return dict(spec_num_drafts_total=s.num_drafts,
                    spec_num_draft_tokens_total=s.num_draft_tokens,
                    spec_num_accepted_tokens_total=s.num_accepted_tokens,
                    spec_accepted_per_pos_total=list(s.accepted_per_pos))

    def server_info(self) -> dict:
        return {
            "model": self.info.name,
            "max_model_len": self.max_model_len,
            **self.runner.info(),
            "page_size": self.args.page_size,
            "max_running_requests": self.args.max_running_requests,
            "chunked_prefill_size": self.args.chunked_prefill_size,
            "max_prefill_tokens": self.args.max_prefill_tokens,
            "schedule_policy": self.args.schedule_policy,
            "sjf_max_wait": self.args.sjf_max_wait,
            "retraction_policy": self.args.retraction_policy,
            "batching": self.args.batching,
            "prefix_cache": not self.args.disable_prefix_cache,
            "grammar_backend": self.grammars.backend.name,
            "grammar_compile_timeout": self.args.grammar_compile_timeout,
            "speculative": self.spec.info() if self.spec is not None else None,
        }


def prompt_logprobs(req: Request, begin: int, rows: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens that a chunk's rows predict (row j, at position
    begin + j, predicts token begin + j + 1), skipping those a retracted run already gave.

    One log-softmax over the chunk's rows, then a gather and a top-k: only those leave here."""
    prompt, out = req.prompt_ids, req.prompt_logprobs
    if not out:
        out.append(LogprobOut(prompt[0], 0.0))  # nothing precedes it: no logprob
    assert begin < len(out), "a chunk past the prompt logprobs so far (a cached prefix?)"
    lo, hi = max(len(out), begin + 1), min(len(prompt), begin + rows.shape[0] + 1)
    if lo >= hi:
        return
    lp = rows[lo - 1 - begin:hi - 1 - begin].float().log_softmax(-1)
    ids = torch.tensor(prompt[lo:hi], device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp > chosen).sum(-1).add_(1).tolist()
    k = req.params.prompt_logprobs
    top_v, top_i = lp.topk(k, dim=-1)
    for t, v, r, tv, ti in zip(prompt[lo:hi], chosen[:, 0].tolist(), ranks, top_v.tolist(),
                               top_i.tolist(), strict=True):
        out.append(LogprobOut(t, v, list(zip(ti, tv, strict=True)), rank=r))


def scheduler_config(args: ServerArgs, max_model_len: int) -> SchedulerConfig:
    """The scheduler's settings from the server flags."""
    return SchedulerConfig(
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=max(args.max_prefill_tokens, 1),
        schedule_policy=args.schedule_policy,
        sjf_max_wait_s=args.sjf_max_wait,
        retraction_policy=args.retraction_policy,
        batching=args.batching,
        batch_wait_ms=args.batch_wait_ms,
        conservativeness=args.schedule_conservativeness,
        max_model_len=max_model_len,
        max_loras_per_batch=args.max_loras_per_batch,
    )
