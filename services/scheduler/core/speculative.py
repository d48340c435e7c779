"""Speculative decoding: guess a decoding request's next tokens, verify them in one step.

Each step, before scheduling, every running request that is decoding gets up to k draft
tokens from the proposer (`Request.draft_ids`). The scheduler computes its last real token and
the drafts as one extend of 1 + m positions, and the model returns logits for all of them:

    tokens      ... t_last | d_1   d_2   ...  d_m
    logits row        0      1     2    ...   m
    row j predicts the token after d_j (row 0: after t_last)

The engine samples every row with the request's own sampler, as if the drafts before it had
been accepted (position, min_tokens, grammar state), and keeps the longest prefix of drafts
that the samples equal, plus the first sample that differs (or the one after the last draft):
1 to m + 1 tokens a step, never fewer than without speculation.

Why that is exact, greedy or not: our proposals are deterministic (q is one token with
probability 1), and every sample is the inverse-CDF draw the request would make at that
position anyway (its uniform keyed by seed and position, `sampler.uniform`). The standard rule
(accept d with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q))) becomes,
for such a q: accept d with probability p(d), else draw from p without d; drawing x from p and
accepting d when x == d is that rule, with x itself as the redraw. So the output is the
target's distribution, and with a seed it is token for token the output without speculation.

The KV of rejected drafts was written past the accepted length; `Scheduler.accept_drafts`
moves `num_computed` to the accepted end, so those slots are overwritten before a block is
ever full and hashed into the prefix cache, and releases blocks no accepted token reaches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import ServerArgs, speculative_error
from services.scheduler.core.proposer import NgramProposer, Proposer, TokenView
from services.scheduler.core.request import Request, Status
from services.scheduler.core.sampler import needs_counts

ALGORITHMS = ("NGRAM", "STANDALONE", "SELF")
# k where --speculative-num-draft-tokens is unset: n-gram drafts are free to make and bounded by
# their match (NgramProposer's per_match); a draft model's each cost a forward of it
DEFAULT_DRAFTS = {"NGRAM": 8, "STANDALONE": 4, "SELF": 4}
# --speculative-disable-by-batch-size where it is unset. n-gram drafts cost only their verify
# rows (at 4 requests TPOT 1.49x lower, at 64 no loss); a draft model's k forwards grow with
# the batch, and from 4 rows its int4/int8 matmuls leave the factored path: SELF's int4 copy
# (SmolLM2 float32, AVX2 EPYC, grounded12, one process) gave 1.36x the throughput at 2
# requests, 1.30x at 3, 0.77x at 4 and 0.75x at 8
DEFAULT_DISABLE_BY_BATCH_SIZE = {"NGRAM": 8, "STANDALONE": 3, "SELF": 3}


@dataclass
class SpecConfig:
    algorithm: str = "NGRAM"
    num_draft_tokens: int = 8  # k: drafts per request per step
    ngram_min: int = 1
    ngram_max: int = 8
    # NGRAM drafts at most n + this after a suffix of n tokens matched (0: always up to k)
    ngram_per_match: int = 1
    # no drafts while more requests than this run: a large batch is compute-bound, and
    # verifying k drafts each costs about k decode rows' matmul work
    disable_by_batch_size: int = 8
    draft_layers: int | None = None  # SELF: the target's first layers that draft
    draft_quantization: str | None = None  # STANDALONE, SELF: the draft's weights


def spec_config(args: ServerArgs) -> SpecConfig | None:
    """The flags' speculative settings, or None when speculation is off; a bad combination is
    a ValueError naming the flag (the service's start-up error)."""
    if (error := speculative_error(args)) is not None:  # a draft's flag without its algorithm
        raise ValueError(error)
    if args.speculative_algorithm is None:
        return None
    if args.speculative_algorithm not in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {args.speculative_algorithm}: choose from "
                         + ", ".join(ALGORITHMS))
    k = args.speculative_num_draft_tokens
    if k is None:  # measured on grounded12 (docs/design.md, "Speculative decoding")
        k = DEFAULT_DRAFTS[args.speculative_algorithm]
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    batch = args.speculative_disable_by_batch_size
    if batch is None:
        batch = DEFAULT_DISABLE_BY_BATCH_SIZE[args.speculative_algorithm]
    return SpecConfig(algorithm=args.speculative_algorithm, num_draft_tokens=k, ngram_min=lo,
                      ngram_max=hi, disable_by_batch_size=batch,
                      draft_layers=args.speculative_draft_layers,
                      draft_quantization=args.speculative_draft_model_quantization)


@dataclass
class SpecStats:
    """vLLM's counters: steps that verified drafts, drafts proposed, drafts accepted, and
    accepted drafts by their position in the proposal (the first accepted most often)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Gives running requests their drafts each step, and counts what verification kept."""

    def __init__(self, config: SpecConfig, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max,
                                                  config.ngram_per_match)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_draft_tokens)

    def propose(self, running: list[Request]) -> None:
        """Set `draft_ids` of each running request that decodes (empty for the rest)."""
        active = len(running) <= self.config.disable_by_batch_size
        drafting, ks = [], []
        for req in running:
            req.draft_ids = []
            k = self._budget(req) if active and self._may_draft(req) else 0
            if k > 0:
                drafting.append(req)
                ks.append(k)
        if not drafting:
            return
        if hasattr(self.proposer, "propose_batch"):  # a draft model: one forward per draft
            proposals = self.proposer.propose_batch(drafting, ks)
        else:
            proposals = [self._propose_one(req, k) for req, k in zip(drafting, ks, strict=True)]
        for req, drafts in zip(drafting, proposals, strict=True):
            if drafts and req.matcher is not None:
                drafts = grammar_prefix(req, drafts)
            req.draft_ids = drafts

    def check_integrity(self) -> None:
        """Idle: a draft model's KV pool holds nothing."""
        pool = getattr(self.proposer, "pool", None)
        if pool is not None:
            pool.check_integrity()
            assert pool.num_used == 0, f"{pool.num_used} draft KV blocks held while idle"

    def release(self, req: Request) -> None:
        """The request has left: its proposer state goes (a draft model's KV blocks)."""
        if hasattr(self.proposer, "release"):
            self.proposer.release(req)
        req.proposer_state = None

    def _may_draft(self, req: Request) -> bool:
        """Decoding, and nothing about it that verification would have to replay per row:
        penalties count the output so far, so a row after a draft would need its own counts."""
        return (req.status is Status.RUNNING and req.num_to_compute == 1
                and req.num_computed >= len(req.prompt_ids) and not needs_counts(req.params))

    def _budget(self, req: Request) -> int:
        """Drafts the request may take: never past what it may still emit (the token after
        the drafts is emitted too), nor past the context."""
        limit = req.params.max_new_tokens
        left = (limit - req.num_generated if limit is not None else self.max_model_len) - 1
        return min(self.config.num_draft_tokens, left, self.max_model_len - req.num_tokens - 1)

    def _propose_one(self, req: Request, k: int) -> list[int]:
        if req.proposer_state is None:
            req.proposer_state = self.proposer.new_state()
        return self.proposer.propose(TokenView(req.prompt_ids, req.output_ids), k,
                                     req.proposer_state)

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.record(drafted, accepted)

    def info(self) -> dict:
        """The settings and the acceptance so far (`/get_server_info`, the start-up log)."""
        c = self.config
        return {"algorithm": c.algorithm, "num_draft_tokens": c.num_draft_tokens,
                "ngram_min_match_window_size": c.ngram_min,
                "ngram_max_match_window_size": c.ngram_max,
                "disable_by_batch_size": c.disable_by_batch_size,
                **({"draft_layers": c.draft_layers} if c.draft_layers is not None else {}),
                **({"draft_model_quantization": c.draft_quantization}
                   if c.draft_quantization is not None else {}),
                "acceptance_rate": round(self.stats.acceptance_rate, 4)}


def grammar_prefix(req: Request, drafts: list[int]) -> list[int]:
    """The drafts the request's grammar allows, up to the first it refuses or the one that
    ends it: a draft the grammar forbids would never be sampled, and after the end there is no
    row to mask (the row before it samples the end itself)."""
    matcher = req.matcher
    tried = kept = 0
    for token in drafts:
        if not matcher.accept(token):
            break
        tried += 1
        if matcher.is_terminated():
            break
        kept += 1
    matcher.rollback(tried)
    return drafts[:kept]


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the samples agree with, from the first (sampled[j] verifies drafts[j])."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n
