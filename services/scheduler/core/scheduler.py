"""Iteration-level scheduling: which requests run this step, with how many tokens each.

Each step: every running request that is decoding gets its one token; running requests that
are still prefilling, then waiting requests, get prompt chunks within the step's prefill
budget. A step that cannot get KV blocks retracts running requests by the retraction policy.
The scheduler only keeps the books; the model runner does the compute.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.block_hash import extend_block_hashes
from common.messages import Finish
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request, Status

# Most prompt rows per step for a request that asks its prompt's logprobs: their logits are
# [rows, vocab] (50 MB in float32 for SmolLM2's 49k vocabulary), plus the log-softmax of them.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SchedulerConfig:
    max_running_requests: int = 128
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 2048
    schedule_policy: str = "sjf"  # sjf | fcfs | lpm | priority
    # sjf: a request that has waited this long is no longer overtaken by shorter ones
    sjf_max_wait_s: float = 5.0
    retraction_policy: str = "length"  # length | priority
    batching: str = "continuous"  # continuous | static | dynamic
    batch_wait_ms: float = 20.0
    max_model_len: int = 8192
    # Admission reserves this fraction of each running request's remaining output (SGLang's
    # new-token ratio). It decays while all goes well and jumps back after a retraction, so a
    # retracted request is readmitted only with headroom: no retraction storms.
    init_new_token_ratio: float = 0.7
    conservativeness: float = 1.0  # scales the reservation; 0 admits whatever fits right now
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    max_loras_per_batch: int = 4  # distinct LoRA adapters among the running requests


@dataclass
class ScheduledBatch:
    reqs: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens computed per request this step
    retracted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished with an error while scheduling

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.reqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.num_retractions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self.routed_predicted_total = 0
        self.routed_cached_total = 0

    # -- queue --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING  # new, or its grammar just compiled
        self.waiting.append(req)

    def hold(self, req: Request) -> None:
        """Known but not yet schedulable: its grammar is still compiling (`add` when done)."""
        req.status = Status.WAITING_FOR_GRAMMAR

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it (abort or error)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        prefill_budget = self.config.max_prefill_tokens
        decoding = [r for r in self.running if not self._is_prefill(r)]
        prefilling = [r for r in self.running if self._is_prefill(r)]
        for req in decoding + prefilling:
            if req.status is not Status.RUNNING:
                continue  # retracted as a victim earlier in this loop
            # a prompt's last token is a 1-token prefill chunk, and spends the budget like one
            prefill = self._is_prefill(req)
            n = min(req.num_to_compute, self._chunk_size(req),
                    prefill_budget) if prefill else 1 + self._drafts_to_verify(req, prefill_budget)
            if n <= 0:
                continue
            if not self._reserve_blocks(req, n, batch):
                continue
            if prefill:
                prefill_budget -= n
            else:
                prefill_budget -= n - 1  # drafts are verified within the step's token budget
            batch.reqs.append(req)
            batch.num_new.append(n)
        self._admit(batch, prefill_budget)
        self._update_ratio(batch)
        return batch

    def _drafts_to_verify(self, req: Request, budget: int) -> int:
        """How many of a decoding request's drafts run this step: all of them if the token
        budget and free blocks allow (drafts never make anyone retract), else none."""
        m = len(req.draft_ids)
        # a block of headroom per running request, so that no decode after this one retracts
        if m and (m > budget or self._blocks_needed(req, 1 + m) + len(self.running)
                  > self.pool.num_evictable):
            req.draft_ids = []
            m = 0
        return m

    def _chunk_size(self, req: Request) -> int:
        """A request collecting prompt logprobs takes the logits of every row of its chunk
        (a 2,048-row chunk over a 49k vocabulary is 400 MB in float32): smaller chunks."""
        if req.prompt_logprobs is not None and req.collects_prompt_logprobs:
            return min(self.config.chunked_prefill_size, PROMPT_LOGPROBS_CHUNK)
        return self.config.chunked_prefill_size

    @staticmethod
    def _is_prefill(req: Request) -> bool:
        """More than one token to compute, or any prompt token: not a plain decode."""
        return req.num_to_compute > 1 or req.num_computed < len(req.prompt_ids)

    def _reserve_blocks(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Get blocks for `n` more tokens of a running request, retracting others if needed."""
        need = self._blocks_needed(req, n)
        while need > self.pool.num_evictable:
            victim = self._pick_victim()
            if victim is req and len(self.running) == 1:
                self._fail(req, batch, self._too_big_message(req))
                return False
            self._retract(victim, batch)
            if victim is req:
                return False
        req.block_table += self.pool.allocate(need)
        return True

    def _admit(self, batch: ScheduledBatch, prefill_budget: int) -> None:
        if not self._may_admit():
            return
        limit = self.config.max_running_requests
        static = self.config.batching != "continuous"
        self._order_waiting()
        in_flight = self._blocks_in_flight()
        riders: list[Request] = []  # wait for a running prefill's blocks, keep their place
        while self.waiting and len(self.running) < limit and (prefill_budget > 0 or static):
            req = self.waiting.popleft()
            if not self._fits(req):
                if self.running:
                    self.waiting.appendleft(req)
                    break
                self._fail(req, batch, self._too_big_message(req))
                continue
            hits = self._cached_prefix(req)
            if self._rides_on(req, hits, in_flight):
                riders.append(req)
                continue
            if not self._headroom_ok(req, hits) or not self._adapter_fits(req):
                self.waiting.appendleft(req)
                break  # the head waits, and so does everyone behind it: no starvation
            prefill_budget -= self._start(req, batch, prefill_budget)
            in_flight.update(self._prompt_blocks_to_compute(req))
        self.waiting.extendleft(reversed(riders))

    def _start(self, req: Request, batch: ScheduledBatch, prefill_budget: int) -> int:
        """Admit `req` (its cached prefix taken) with its first chunk if blocks allow; the
        prompt tokens it computes this step."""
        self._match_prefix(req)
        req.status = Status.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)
        n = min(req.num_to_compute, self._chunk_size(req), prefill_budget)
        if n <= 0:
            return 0  # static batching: admitted now, prefilled in later steps
        need = self._blocks_needed(req, n)
        if need > self.pool.num_evictable:
            return 0  # admitted; its prefill waits for blocks in a later step
        req.block_table += self.pool.allocate(need)
        batch.reqs.append(req)
        batch.num_new.append(n)
        return n

    # -- prompts sharing a prefix with a running prefill -----------------------------------------
    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of the prompt blocks running requests have yet to compute: each becomes a
        cached block within a few steps."""
        if not self.pool.enable_prefix_cache:
            return set()
        pending: set[bytes] = set()
        for r in self.running:
            pending.update(self._prompt_blocks_to_compute(r))
        return pending

    def _prompt_blocks_to_compute(self, req: Request) -> list[bytes]:
        if not self.pool.enable_prefix_cache:
            return []
        first, end = req.num_computed // self.page_size, len(req.prompt_ids) // self.page_size
        if first >= end:
            return []
        self._extend_hashes(req, end)
        return req.block_hashes[first:end]

    def _rides_on(self, req: Request, hits: list[int], in_flight: set[bytes]) -> bool:
        """The first block this request would compute is one a running prefill computes right
        now: wait for it to be cached rather than compute the same prefix again beside it (a
        burst sharing a document prefills the document once, then every question)."""
        if not in_flight or req.collects_prompt_logprobs:
            return False
        hashes = self._hashes(req)
        return len(hits) < len(hashes) and hashes[len(hits)] in in_flight

    def _adapter_fits(self, req: Request) -> bool:
        """Every running request computes each step, so the running requests' distinct LoRA
        adapters are a step's: one more only while under --max-loras-per-batch."""
        if req.lora_name is None:
            return True
        active = {r.lora_name for r in self.running if r.lora_name is not None}
        return req.lora_name in active or len(active) < self.config.max_loras_per_batch

    def _may_admit(self) -> bool:
        if self.config.batching == "continuous":
            return True
        if self.running:
            return False  # static and dynamic: a new group only once the last one is done
        if self.config.batching == "dynamic" and self.waiting:
            full = len(self.waiting) >= self.config.max_running_requests
            waited = (time.monotonic() - self.waiting[0].arrival_time) * 1000
            return full or waited >= self.config.batch_wait_ms
        return True

    def _order_waiting(self) -> None:
        policy = self.config.schedule_policy
        if policy == "sjf" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._sjf_key))  # stable: FCFS on ties
        elif policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=lambda r: -r.priority))  # stable
        elif policy == "lpm" and 1 < len(self.waiting) <= 128:
            # Longest cached prefix first; on a long queue matching costs more than it saves.
            self.waiting = deque(
                sorted(self.waiting, key=lambda r: -len(self.pool.match_prefix(self._hashes(r))))
            )

    def _sjf_key(self, req: Request) -> int:
        """Shortest prompt first: in a burst, the median request waits for the short prompts
        ahead of it, not for every prompt that arrived before it (half the TTFT p50 of FCFS on
        a burst of 64). A retracted request (it was running) and one that has waited
        `sjf_max_wait_s` go first, in queue order: no request is overtaken forever."""
        waited = time.monotonic() - req.arrival_time
        if req.num_retractions or waited >= self.config.sjf_max_wait_s:
            return -1
        return req.num_tokens

    def _fits(self, req: Request) -> bool:
        """Could this request ever fit: its tokens so far plus one more in the whole pool?"""
        return self._num_blocks(req.num_tokens + 1) <= self.pool.num_blocks

    def _headroom_ok(self, req: Request, hits: list[int]) -> bool:
        """Admit only if the blocks running requests will still need (their remaining output
        scaled by the new-token ratio) plus this request's leave the pool non-negative. Its
        cached prefix `hits` costs nothing where running requests hold those blocks already."""
        if not self.running:
            return True
        shared = sum(1 for b in hits if self.pool.ref_cnt[b] > 0)
        want = sum(self._future_blocks(r) for r in self.running) + self._future_blocks(req)
        return want - shared <= self.pool.num_evictable

    def _future_blocks(self, req: Request) -> int:
        limit = req.params.max_new_tokens
        if limit is None:
            limit = self.config.max_model_len - len(req.prompt_ids)
        remaining_out = max(0, limit - req.num_generated)
        ratio = self.new_token_ratio * self.config.conservativeness
        total = req.num_tokens + int(remaining_out * ratio)
        return max(0, self._num_blocks(total) - len(req.block_table))

    def _update_ratio(self, batch: ScheduledBatch) -> None:
        if batch.retracted:
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        else:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )

    # -- prefix cache ---------------------------------------------------------------------------
    def _hashes(self, req: Request) -> list[bytes]:
        """Hashes of the full blocks a prefix hit may cover (never the last token)."""
        usable = (req.num_tokens - 1) // self.page_size
        self._extend_hashes(req, usable)
        return req.block_hashes[:usable]

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        extend_block_hashes(req.block_hashes, req.tokens, self.page_size, num_blocks,
                            req.cache_salt, req.lora_name)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks a waiting request would start from (no references taken). A
        cached prefix has no logits: a request that wants its prompt's logprobs computes it
        all (its blocks are still registered for the others)."""
        if req.num_computed or req.block_table or not self.pool.enable_prefix_cache:
            return []
        if req.collects_prompt_logprobs:
            return []
        return self.pool.match_prefix(self._hashes(req))

    def _match_prefix(self, req: Request) -> None:
        if req.num_computed or req.block_table:
            return
        first_time = req.num_retractions == 0
        hits = self._cached_prefix(req)
        self.pool.acquire(hits)
        req.block_table = list(hits)
        req.num_computed = len(hits) * self.page_size
        if first_time:
            req.num_cached = min(req.num_computed, len(req.prompt_ids))
            self.prefix_queries_total += len(req.prompt_ids)
            self.prefix_hits_total += req.num_cached
            if req.predicted_cached is not None:  # a router sent it here for its prefix
                self.routed_predicted_total += req.predicted_cached
                self.routed_cached_total += req.num_cached

    def cache_computed_blocks(self, req: Request) -> None:
        """Make the request's fully computed blocks findable (after a step, abort or finish)."""
        if not self.pool.enable_prefix_cache:
            return
        full = min(req.num_computed, req.num_tokens) // self.page_size
        self._extend_hashes(req, full)
        for i in range(full):
            self.pool.register(req.block_table[i], req.block_hashes[i],
                               req.block_hashes[i - 1] if i else None, req.lora_name)

    # -- leaving ------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        self.cache_computed_blocks(req)
        self.pool.release(req.block_table)
        req.block_table = []

    def finish(self, req: Request, finish: Finish) -> None:
        self.remove(req)
        self.free(req)
        req.draft_ids = []
        req.status = Status.FINISHED
        req.finish = finish

    def _fail(self, req: Request, batch: ScheduledBatch, message: str) -> None:
        self.finish(req, Finish(kind="error", message=message, status=400))
        batch.failed.append(req)

    def _too_big_message(self, req: Request) -> str:
        cap = self.pool.num_blocks * self.page_size
        return (f"request needs {req.num_tokens + 1} tokens of KV cache but the whole pool "
                f"holds {cap}; raise --max-total-tokens or shorten the prompt")

    # -- retraction ---------------------------------------------------------------------------
    def _pick_victim(self) -> Request:
        if self.config.retraction_policy == "priority":
            key = lambda r: (r.priority, r.num_generated, -len(r.prompt_ids))  # noqa: E731
        else:
            key = lambda r: (r.num_generated, -len(r.prompt_ids))  # noqa: E731
        # Among equals the latest admitted goes first: it has the least work to redo.
        return min(reversed(self.running), key=key)

    def _retract(self, req: Request, batch: ScheduledBatch) -> None:
        """Free a running request's blocks and requeue it at the front; it resumes by recompute."""
        if req in batch.reqs:
            i = batch.reqs.index(req)
            del batch.reqs[i], batch.num_new[i]
        self.running.remove(req)
        self.free(req)
        req.num_computed = 0
        req.draft_ids = []
        req.status = Status.WAITING
        req.num_retractions += 1
        self.num_retractions_total += 1
        self.waiting.appendleft(req)
        batch.retracted.append(req)

    # -- after the forward ----------------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward: the tokens each request computed have KV (a verifying request's
        drafts not yet: `accept_drafts` says how many of them count)."""
        for req, n in zip(batch.reqs, batch.num_new, strict=True):
            req.num_computed += n - len(req.draft_ids)
            self.cache_computed_blocks(req)

    def accept_drafts(self, req: Request, accepted: int) -> None:
        """The first `accepted` drafts were right: their KV stays. The rest of the drafts' slots
        lie past num_computed, to be overwritten; blocks only they reached go back."""
        req.num_computed += accepted
        req.draft_ids = []
        keep = self._num_blocks(req.num_computed + 1)
        if len(req.block_table) > keep:
            self.pool.release(req.block_table[keep:])
            del req.block_table[keep:]

    def unaccept_drafts(self, req: Request, n: int) -> None:
        """The last `n` drafts `accept_drafts` kept are not output after all (a token before
        them was replaced): their slots lie past num_computed again. Nothing was cached from
        them: blocks are registered at a step's advance or a request's end, not here."""
        req.num_computed -= n
        keep = self._num_blocks(req.num_computed + 1)
        if len(req.block_table) > keep:
            self.pool.release(req.block_table[keep:])
            del req.block_table[keep:]

    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, self._num_blocks(req.num_computed + n) - len(req.block_table))

    def _num_blocks(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        assert not any(r.block_table for r in self.waiting), "waiting request holds blocks"
        # every used block is referenced once per block table holding it (shared prefixes)
        refs: dict[int, int] = {}
        for r in self.running:
            for b in r.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b, n in refs.items():
            assert self.pool.ref_cnt[b] == n, f"block {b}: {self.pool.ref_cnt[b]} refs, {n} holders"
        assert len(refs) == self.pool.num_used, "a used block that no request holds: a leak"
