"""Every message on the wire: msgspec Structs, tagged, encoded as msgpack.

Names end in Req (asks a stage to do something) or Out (a stage's result), as SGLang does.
Trace context travels in NATS headers, never here.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class StructuredOutputs(msgspec.Struct, omit_defaults=True):
    """A constraint on the output, as vLLM's `StructuredOutputsParams` names it: set at most one.

    The scheduler compiles it into a grammar (`services/scheduler/core/grammar.py`) that masks every
    sampled token, so the output is in the grammar's language however small the model."""

    json: str | dict | None = None  # a JSON schema (as text or as a dict)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF, in xgrammar's (GBNF-like) dialect
    # The request field it came from (`response_format`, `structured_outputs.regex`, ...): an
    # error compiling it names that field.
    param: str | None = None

    def kinds(self) -> list[str]:
        """The constraints that are set (a valid one has exactly one)."""
        kinds = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None]
        return kinds + (["json_object"] if self.json_object else [])


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_new_tokens: int | None = None  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the top k
    # the prompt's own tokens' logprobs, from its prefill (None: none; k: also the top k)
    prompt_logprobs: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


FinishKind = Literal["stop", "length", "abort", "error"]


class Finish(msgspec.Struct, omit_defaults=True):
    """Why a request ended. `matched` is the stop string or token id that ended it."""

    kind: FinishKind
    matched: str | int | None = None
    message: str | None = None
    status: int | None = None  # HTTP status for abort/error
    param: str | None = None  # the request field an error is about


class GenerateReq(msgspec.Struct, tag=True, omit_defaults=True):
    """gateway -> tokenizer: one request as the client sent it."""

    rid: str
    gateway_id: str
    params: SamplingParams
    text: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # OpenAI `tools`, rendered into the prompt
    priority: int = 0
    arrival_time: float = 0.0
    # Tokens a client already received: a request moved off a dead scheduler resumes after them.
    output_ids: list[int] = msgspec.field(default_factory=list)
    scheduler_id: str | None = None  # pin to one scheduler (None: any, via the queue group)
    # Prefix-cache isolation: only requests with the same salt share cached blocks (vLLM's name).
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter to run under (None: the base model)


class TokenizedReq(msgspec.Struct, tag=True, omit_defaults=True):
    """tokenizer -> scheduler."""

    rid: str
    gateway_id: str
    input_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    output_ids: list[int] = msgspec.field(default_factory=list)
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter to run under (None: the base model)
    # Prompt tokens the router expected this scheduler to hold (None: not routed by prefix);
    # the scheduler counts it against what it then finds, the router's accuracy.
    predicted_cached_tokens: int | None = None


class TokenizeReq(msgspec.Struct, tag=True, omit_defaults=True):
    """gateway -> any tokenizer (request/reply): a prompt's token ids, for /tokenize. `text` is
    encoded as /v1/completions encodes a prompt, `messages` rendered as /v1/chat/completions
    renders them (the same code), so the ids are those a request would be scheduled with."""

    text: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    add_special_tokens: bool = True  # on top of what the chat template writes itself
    return_token_strs: bool = False


class TokenizeOut(msgspec.Struct, tag=True, omit_defaults=True):
    """tokenizer -> gateway: the ids (an error comes back as ErrorOut instead)."""

    input_ids: list[int]
    token_strs: list[str] | None = None  # the vocabulary's pieces, as asked


class LogprobOut(msgspec.Struct, array_like=True, omit_defaults=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)
    rank: int | None = None  # of token_id among the vocabulary, 1 the likeliest (prompts only)


class TokenOut(msgspec.Struct, omit_defaults=True):
    """One request's share of an engine step."""

    rid: str
    gateway_id: str
    token_ids: list[int]
    finish: Finish | None = None
    # output tokens of this request reported before these (resumed ones' included): a receiver
    # whose count differs lost a message on a NATS node that died (None: not checked)
    offset: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[LogprobOut] | None = None
    # One per prompt token, sent once, when the prefill has computed them all. Entry 0 is the
    # first token, which nothing precedes: it has no logprob (0.0 here, null to the client).
    prompt_logprobs: list[LogprobOut] | None = None
    # Set on a request's first output only: what the detokenizer needs to know about it.
    first: bool = False
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    queue_time: float | None = None  # seconds between arrival at the scheduler and first step
    retractions: int = 0
    # First output of a request resumed after tokens the client already has (moved off a dead
    # scheduler): the detokenizer decodes them again for left context, so its text restarts
    # from the beginning, and the gateway drops the part its client already received.
    prior_ids: list[int] | None = None


class BatchTokenOut(msgspec.Struct, tag=True, omit_defaults=True):
    """scheduler -> detokenizer: every request of one engine step routed to that detokenizer."""

    scheduler_id: str
    items: list[TokenOut]


class TextOut(msgspec.Struct, omit_defaults=True):
    rid: str
    text: str
    token_ids: list[int]
    finish: Finish | None = None
    offset: int | None = None  # as TokenOut's; the gateway resumes a request whose count differs
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[LogprobOut] | None = None
    prompt_logprobs: list[LogprobOut] | None = None  # as in TokenOut
    scheduler_id: str | None = None
    queue_time: float | None = None
    retractions: int = 0


class BatchTextOut(msgspec.Struct, tag=True, omit_defaults=True):
    """detokenizer -> gateway: every request of that gateway with output since the last flush."""

    items: list[TextOut]


class AcceptedOut(msgspec.Struct, tag=True, omit_defaults=True):
    """scheduler -> gateway, on receipt: this scheduler owns the request from now on.

    The gateway learns who owns a request before its first token, so a request still queued at
    a scheduler that dies is moved like one that was streaming.
    """

    rid: str
    scheduler_id: str


class ReceiptOut(msgspec.Struct, tag=True):
    """Any subscriber -> the sender of a message sent with `Bus.publish_acked`, on receipt
    (before handling it): who took it. No receipt at all means nobody listens."""

    service: str
    instance_id: str


class ErrorOut(msgspec.Struct, tag=True, omit_defaults=True):
    """Any stage -> gateway: the request failed; the gateway answers the client with it."""

    rid: str
    message: str
    status: int = 400
    err_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class AbortReq(msgspec.Struct, tag=True, omit_defaults=True):
    """Broadcast: stop a request wherever it is and free what it holds."""

    rid: str | None = None
    abort_all: bool = False
    reason: str = "aborted by client"
    # Set: only this scheduler's copy of the request stops (it was moved off that scheduler);
    # schedulers and detokenizers drop what they hold for it there, tokenizers ignore it.
    scheduler_id: str | None = None


class FlushCacheReq(msgspec.Struct, tag=True):
    """gateway -> every scheduler (request/reply): drop the prefix cache."""


class FlushCacheOut(msgspec.Struct, tag=True, omit_defaults=True):
    scheduler_id: str
    ok: bool
    message: str = ""


class LoadLoraReq(msgspec.Struct, tag=True):
    """gateway -> every scheduler (request/reply): read, validate and serve a LoRA adapter."""

    lora_name: str
    lora_path: str


class UnloadLoraReq(msgspec.Struct, tag=True, omit_defaults=True):
    """gateway -> every scheduler (request/reply): stop serving a LoRA adapter (drained)."""

    lora_name: str
    only: list[str] | None = None  # these schedulers' ids (a failed load's undo); None: all


class LoraOut(msgspec.Struct, tag=True, omit_defaults=True):
    """A scheduler's answer to a load or unload: an HTTP status (0: not asked), a message
    naming the problem and its field, and the adapters it serves now (name -> path) as of
    `version` (the time of its last change, ns: the newest view wins)."""

    scheduler_id: str
    status: int
    message: str = ""
    param: str | None = None
    running: int = 0  # an unload: requests still running under the adapter (it drains)
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    version: int = 0


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks that entered a scheduler's prefix cache: a chain, each block the child of
    the one before it, the first the child of `parent_block_hash` (None: of the root)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks evicted from the prefix cache (their memory went to other tokens)."""

    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The prefix cache is empty: flushed, or the scheduler (re)started."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventsOut(msgspec.Struct, tag=True):
    """scheduler -> anyone (`tl.kv_events.<scheduler_id>`): its prefix cache's changes in one
    engine step, in order. `seq` counts 1, 2, 3... per scheduler process: a consumer that sees
    a gap missed a batch and asks for a snapshot (`KvSnapshotReq`)."""

    scheduler_id: str
    seq: int
    block_size: int
    events: list[KvEvent]


class KvSnapshotReq(msgspec.Struct, tag=True):
    """anyone -> one scheduler (request/reply, `tl.kv_snapshot.<scheduler_id>`)."""


class KvSnapshotOut(msgspec.Struct, tag=True):
    """Every block hash the scheduler's prefix cache holds, as of event batch `seq`."""

    scheduler_id: str
    seq: int
    block_size: int
    block_hashes: list[bytes]


# Upper bounds (seconds) of the grammar compile-time histogram the schedulers report.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                           5.0, 10.0)


class StatsOut(msgspec.Struct, tag=True, omit_defaults=True):
    """Every service, periodically: a heartbeat with what it holds and its counters."""

    service: str
    instance_id: str
    time: float
    in_flight: int = 0
    nats_reconnects: int = 0  # times this service's NATS client came back after a drop
    nats_rtt_s: float = 0.0  # its last PING/PONG with its NATS node
    # scheduler only
    num_running: int = 0
    num_waiting: int = 0
    kv_total_blocks: int = 0
    kv_free_blocks: int = 0
    kv_cached_blocks: int = 0
    kv_usage: float = 0.0
    num_retractions_total: int = 0
    num_aborted_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_steps_total: int = 0
    kv_events_seq: int = 0  # the last KvEventsOut published: a consumer behind it missed some
    # prompt tokens routed requests were predicted to find cached, and found (router accuracy)
    routed_predicted_tokens_total: int = 0
    routed_cached_tokens_total: int = 0
    # tokenizer only: routing decisions by reason, and the router's view (scheduler -> blocks)
    route_decisions_total: dict[str, int] | None = None
    router_view: dict[str, int] | None = None
    kv_snapshots_total: int = 0
    grammar_requests_total: int = 0  # requests with a structured-output constraint
    # speculative decoding (vLLM's spec_decode counters): verifies, drafts, accepted drafts,
    # and accepted drafts by position in their proposal
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos_total: list[int] | None = None
    grammar_cache_hits_total: int = 0
    # compile times: a count per GRAMMAR_COMPILE_BUCKETS bound, then one for beyond the last
    grammar_compile_buckets: list[int] = msgspec.field(default_factory=list)
    grammar_compile_seconds_sum: float = 0.0
    info: dict | None = None  # static facts (KV pool, model) for /get_server_info
    # LoRA (scheduler, when enabled): the adapters served (name -> path) as of lora_version
    # (see LoraOut), requests per adapter running and waiting, --max-loras-per-batch
    lora_adapters: dict[str, str] | None = None
    lora_version: int = 0
    lora_running: dict[str, int] | None = None
    lora_waiting: dict[str, int] | None = None
    max_lora: int = 0


Message = (
    GenerateReq
    | TokenizedReq
    | TokenizeReq
    | TokenizeOut
    | BatchTokenOut
    | BatchTextOut
    | AcceptedOut
    | ReceiptOut
    | ErrorOut
    | AbortReq
    | FlushCacheReq
    | FlushCacheOut
    | LoadLoraReq
    | UnloadLoraReq
    | LoraOut
    | KvEventsOut
    | KvSnapshotReq
    | KvSnapshotOut
    | StatsOut
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
