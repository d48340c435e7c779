"""A request inside the engine, and its life cycle.

    WAITING_FOR_GRAMMAR --compiled--> WAITING --schedule--> RUNNING --finish--> FINISHED
    (a constrained request only)          ^                     |    (stop | length | abort
                                          +------retract--------+     | error)
                                 blocks freed, tokens kept, resumed by recomputation

A request's tokens, prompt then output:

    [0, num_cached)             reused from the prefix cache at admission
    [num_cached, num_computed)  KV computed by earlier steps
    [num_computed, len(tokens)) still to compute: a prefill chunk, or the one decode token
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.messages import Finish, LogprobOut, SamplingParams, TokenizedReq

if TYPE_CHECKING:
    import torch

    from common.incremental import IncrementalText
    from services.scheduler.core.closeout import CloseoutState
    from services.scheduler.core.grammar import GrammarJob, Matcher


class Status(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # vLLM's WAITING_FOR_FSM
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    gateway_id: str = ""
    priority: int = 0
    cache_salt: str | None = None  # shares cached blocks only with requests of the same salt
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish: Finish | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at (first) admission
    num_retractions: int = 0
    first_scheduled_time: float | None = None
    seed: int = 0
    # what has been reported so far (outputs resumed from elsewhere count as reported)
    num_reported: int = 0
    reported_first: bool = False
    pending_logprobs: list = field(default_factory=list)
    initial_outputs: int = 0  # outputs it arrived with (resumed from another scheduler)
    predicted_cached: int | None = None  # what the router expected the prefix cache to hold
    # structured outputs: the compile it waits for, then its matcher (which has accepted
    # exactly output_ids, through retraction too)
    grammar_job: GrammarJob | None = None
    matcher: Matcher | None = None
    closeout: CloseoutState | None = None  # JSON: its closing always fits its budget
    # penalties' state, only for a request that has penalties: [V] output token counts, and
    # [V] whether a token is in the prompt or the output
    output_counts: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None
    stop_text: IncrementalText | None = None  # only for a request with stop strings
    # speculative decoding: tokens guessed to follow output_ids, verified this step (never part
    # of `tokens`: only the accepted ones are appended to output_ids)
    draft_ids: list[int] = field(default_factory=list)
    proposer_state: Any = None  # the proposer's own (NgramProposer: its n-gram index)
    # prompt logprobs, only for a request that asks: one per prompt token computed so far
    # (kept through retraction, so a recompute adds none twice), sent out once when complete
    prompt_logprobs: list[LogprobOut] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        # An unseeded request still gets a fixed seed, so retraction never changes its text.
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.num_reported = len(self.output_ids)
        self.initial_outputs = len(self.output_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @classmethod
    def from_msg(cls, msg: TokenizedReq) -> Request:
        return cls(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            params=msg.params,
            gateway_id=msg.gateway_id,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            lora_name=msg.lora_name,
            output_ids=list(msg.output_ids),
            predicted_cached=msg.predicted_cached_tokens,
        )

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are not all computed yet: each prefill row counts."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
