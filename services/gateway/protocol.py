"""HTTP request bodies (msgspec Structs) and their checks, turned into SamplingParams.

A field we do not implement is a 400 naming it, never accepted and ignored (vLLM logs and drops
it; OpenAI itself refuses it): a `guided_json` dropped on the floor is unconstrained output the
client trusts. Every error names the field it is about.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from common.messages import GenerateReq, SamplingParams, StructuredOutputs, TokenizeReq
from services.gateway.constraints import (
    APIFieldError,
    ResponseFormat,
    StructuredOutputsField,
    Tool,
    ToolChoice,
    ToolPlan,
    chat_plan,
    completion_constraint,
    generate_constraint,
    sendable,
)

MAX_N = 16  # most choices (and most prompts) per request
MAX_LOGPROBS = 20
# Far deeper than any real body, far shallower than what a recursive decoder (msgspec, json,
# msgpack on the bus, a chat template) survives: 100,000 levels of `[` are a 400, not a 500.
MAX_JSON_DEPTH = 64
MAX_CACHE_SALT_CHARS = 256

# The ranges live in the types: msgspec checks them while decoding (the error names the field)
# and /openapi.json documents them. Every integer crosses NATS as msgpack int64, so none may be
# larger: a client's 2**70 is a 400, not a crash.
Int = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NonNeg = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Positive = Annotated[int, Meta(ge=1, le=2**63 - 1)]
TopK = Annotated[int, Meta(ge=-1, le=2**63 - 1, description="-1 (off) or >= 1")]
N = Annotated[int, Meta(ge=1, le=MAX_N)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
PromptLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description=(
    "vLLM's: the prompt tokens' logprobs, each with its rank and the N likeliest tokens "
    "(null first); not with stream: true"))]
CompletionMaxTokens = Annotated[int, Meta(ge=0, le=2**63 - 1, description=(
    "0 only with echo or prompt_logprobs: the prompt (and its logprobs) alone"))]
LogprobStartLen = Annotated[int, Meta(ge=-1, le=2**63 - 1, description=(
    "SGLang's: with return_logprob, the prompt's logprobs from this token on (-1: none)"))]
Temperature = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
Bias = Annotated[float, Meta(ge=-100, le=100)]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
    "prefix-cache isolation: only requests with the same salt share cached blocks"))]
# OpenAI's fields that change nothing here, accepted at the shapes and limits OpenAI sets
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16, description="kept by nobody here: at most 16 keys of at most 64 "
                                    "characters, values of at most 512")]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# a chat template that reads any of these runs a model that reasons
REASONING_MARKS = ("reasoning_effort", "enable_thinking", "<think>")


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 err_type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type or _default_type(status)
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


def _default_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_overloaded",
        504: "timeout_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk too


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class Prediction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's predicted output: a hint for speed that never changes the reply, so accepted
    (its shape checked) and not used; vLLM drops it, as it drops any field it does not know."""

    type: Literal["content"]
    content: str | list[TextPart]


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by every route (OpenAI's plus vLLM/SGLang's extras)."""

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    n: N = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNeg] | None = None
    seed: Int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, Bias] | None = None
    ignore_eos: bool = False
    min_tokens: NonNeg = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = 0
    user: str | None = None
    cache_salt: CacheSalt | None = None
    lora_path: str | None = None  # SGLang's: the LoRA adapter's name (--lora-paths)
    # at most one output constraint (services/gateway/constraints.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def check_stream_options(self) -> None:
        """Unstreamed, stream_options change nothing (the body carries the usage anyway); vLLM
        refuses them there, and silently drops continuous_usage_stats without include_usage."""
        opts = self.stream_options
        _check(opts is None or opts.include_usage or not opts.continuous_usage_stats,
               "stream_options.continuous_usage_stats needs stream_options.include_usage: true",
               "stream_options.continuous_usage_stats")


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[Any]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call (constraints.ToolPlan.parallel)
    # OpenAI's that change nothing here (docs/design.md, "Interfaces users see")
    metadata: Metadata | None = None
    store: bool | None = None  # only false: we keep no responses
    service_tier: ServiceTier | None = None  # one tier here
    prediction: Prediction | None = None
    reasoning_effort: ReasoningEffort | None = None  # only for a model that does not reason

    def tool_plan(self) -> tuple[StructuredOutputs | None, ToolPlan | None, list[dict] | None]:
        """The output constraint, what to do with tools, and the tools for the prompt."""
        return _field_errors(chat_plan, self.tools, self.tool_choice, self.parallel_tool_calls,
                             self.response_format, self.structured_outputs)

    def prompt(self) -> dict:
        """Refuse here what could not even reach the tokenizer (it checks roles and content)."""
        check_messages(self.messages)
        _, _, tools = self.tool_plan()
        return {"messages": self.messages, "add_generation_prompt": self.add_generation_prompt,
                "tools": tools}

    def check_unused(self, chat_template: str | None) -> None:
        """The OpenAI fields accepted because they change nothing here: refused where they
        would (a stored response, a reasoning model's effort)."""
        _check(not self.store, "store: true is not supported: this server keeps no responses",
               "store")
        reasons = any(mark in (chat_template or "") for mark in REASONING_MARKS)
        _check(self.reasoning_effort is None or not reasons, "reasoning_effort is not "
               "supported: this model's chat template reasons, and its effort is not passed "
               "on", "reasoning_effort")

    def to_params(self, vocab_size: int, max_stops: int) -> SamplingParams:
        _check(not self.top_logprobs or self.logprobs, "top_logprobs needs logprobs: true",
               "top_logprobs")
        self.check_stream_options()
        _check_prompt_logprobs(self.prompt_logprobs, self.stream)
        newer = self.max_completion_tokens is not None  # OpenAI's new name wins
        constraint, _, _ = self.tool_plan()
        params = _sampling_params(
            self, constraint=constraint,
            max_tokens=self.max_completion_tokens if newer else self.max_tokens,
            min_tokens=self.min_tokens,
            max_tokens_param="max_completion_tokens" if newer else "max_tokens",
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            vocab_size=vocab_size, max_stops=max_stops)
        params.prompt_logprobs = self.prompt_logprobs
        return params


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked later)
    max_tokens: CompletionMaxTokens | None = None
    logprobs: Logprobs | None = None
    echo: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    best_of: Int | None = None
    suffix: str | None = None

    def prompts(self, vocab_size: int) -> list[dict]:
        """One entry per prompt: a string, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"text": prompt}]
        _check(bool(prompt), "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in prompt):
            return [{"input_ids": _token_ids(prompt, vocab_size)}]
        _check(len(prompt) <= MAX_N, f"at most {MAX_N} prompts per request", "prompt")
        out = []
        for x in prompt:
            if isinstance(x, str):
                out.append({"text": x})
            elif isinstance(x, list) and x and all(isinstance(t, int) for t in x):
                out.append({"input_ids": _token_ids(x, vocab_size)})
            else:
                raise APIError("prompt must be a string, a list of strings, a list of token "
                               "ids, or a list of such lists", "prompt")
        return out

    def to_params(self, vocab_size: int, max_stops: int) -> SamplingParams:
        _check(self.best_of is None or self.best_of == self.n,
               "best_of other than n is not supported", "best_of")
        _check(not self.suffix, "suffix is not supported", "suffix")
        self.check_stream_options()
        _check_prompt_logprobs(self.prompt_logprobs, self.stream)
        _check(self.max_tokens != 0 or self.echo or self.prompt_logprobs is not None,
               "max_tokens must be at least 1 (0 only with echo or prompt_logprobs)",
               "max_tokens")
        constraint = _field_errors(completion_constraint, self.response_format,
                                   self.structured_outputs)
        params = _sampling_params(
            self, constraint=constraint,
            max_tokens=16 if self.max_tokens is None else self.max_tokens,
            min_tokens=self.min_tokens, max_tokens_param="max_tokens", logprobs=self.logprobs,
            vocab_size=vocab_size, max_stops=max_stops)
        params.prompt_logprobs = self.prompt_top_n()
        return params

    def prompt_top_n(self) -> int | None:
        """What the engine computes for the prompt: the wider of echo's logprobs (echo shows
        the prompt's tokens with the output's) and prompt_logprobs."""
        echoed = self.logprobs if self.echo else None
        asked = [n for n in (echoed, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None


class GenerateSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: Positive | None = 128
    min_new_tokens: NonNeg = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: Probability = 0.0
    seed: Int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: dict[str, Bias] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNeg] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: N = 1
    # SGLang's constraints (at most one)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's native /generate."""

    text: str | None = None
    input_ids: list[NonNeg] | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(
        default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    priority: Int = 0
    return_logprob: bool = False
    top_logprobs_num: Logprobs = 0
    logprob_start_len: LogprobStartLen = -1
    cache_salt: CacheSalt | None = None
    lora_path: str | None = None  # SGLang's: the LoRA adapter's name (--lora-paths)

    def prompt(self) -> dict:
        _check((self.text is None) != (self.input_ids is None),
               "give exactly one of `text` or `input_ids`", "text")
        return {"text": self.text} if self.text is not None else {"input_ids": self.input_ids}

    def to_params(self, vocab_size: int, max_stops: int) -> SamplingParams:
        sp = self.sampling_params
        constraint = _field_errors(generate_constraint, sp.json_schema, sp.regex, sp.ebnf)
        try:
            params = _sampling_params(
                sp, constraint=constraint,
                max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens,
                max_tokens_param="max_new_tokens",
                logprobs=self.top_logprobs_num if self.return_logprob else None,
                vocab_size=vocab_size, max_stops=max_stops)
        except APIError as exc:
            exc.param = f"sampling_params.{exc.param}" if exc.param else exc.param
            raise
        if self.return_logprob and self.logprob_start_len >= 0:
            params.prompt_logprobs = self.top_logprobs_num
        return params


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a `prompt` (encoded as /v1/completions encodes one) or `messages`
    (rendered as /v1/chat/completions renders them), exactly one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool | None = False
    # messages only
    add_generation_prompt: bool | None = None  # default true
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_msg(self) -> TokenizeReq:
        _check((self.prompt is None) != (self.messages is None),
               "give exactly one of `prompt` or `messages`", "prompt")
        if self.prompt is not None:
            self.check_fields()
            return TokenizeReq(text=self.prompt, add_special_tokens=self.add_special_tokens
                               is not False, return_token_strs=bool(self.return_token_strs))
        check_messages(self.messages)
        _check(not self.continue_final_message, "continue_final_message is not supported "
               "(neither is it on /v1/chat/completions)", "continue_final_message")
        _check(not self.chat_template_kwargs, "chat_template_kwargs is not supported (neither "
               "is it on /v1/chat/completions)", "chat_template_kwargs")
        _, _, tools = _field_errors(chat_plan, self.tools, None, True, None, None)
        return TokenizeReq(messages=self.messages, tools=tools,
                           add_generation_prompt=self.add_generation_prompt is not False,
                           add_special_tokens=bool(self.add_special_tokens),
                           return_token_strs=bool(self.return_token_strs))

    def check_fields(self) -> None:
        """A prompt's request: a field of the messages' shape is refused by name, not ignored."""
        for name in ("add_generation_prompt", "tools", "chat_template_kwargs"):
            _check(getattr(self, name) is None, f"{name} applies to `messages` only", name)
        _check(not self.continue_final_message, "continue_final_message applies to "
               "`messages` only", "continue_final_message")


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /detokenize: token ids back to text, special tokens kept."""

    model: str | None = None
    tokens: list[NonNeg]

    def ids(self, vocab_size: int) -> list[int]:
        for t in self.tokens:
            _check(t < vocab_size, f"token id {t} is outside the vocabulary [0, {vocab_size})",
                   "tokens")
        return self.tokens


def check_messages(messages: list[Any]) -> None:
    """What could not even reach the tokenizer (it checks roles and content)."""
    _check(bool(messages), "messages must not be empty", "messages")
    for i, m in enumerate(messages):
        _check(isinstance(m, dict), f"messages[{i}] must be an object", f"messages[{i}]")
    try:
        sendable(messages, "messages")  # e.g. an integer beyond 64 bits
    except APIFieldError as exc:
        raise APIError(str(exc), exc.param) from None


def abort_target(body: bytes) -> str | None:
    """/abort_request's body: the rid to abort, or None for `abort_all: true`."""
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise APIError("the body is not valid JSON", None) from None
    if not isinstance(data, dict):
        raise APIError("the body must be a JSON object", None)
    unknown = sorted(data.keys() - {"rid", "abort_all"})
    if unknown:
        raise _unknown_field(unknown[0], None, GenerateRequest)
    if data.get("abort_all") is True:
        return None
    rid = data.get("rid")
    if not isinstance(rid, str) or not rid:
        raise APIError("give `rid` (a string) or `abort_all: true`", "rid")
    return rid


LoraName = Annotated[str, Meta(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's and SGLang's /load_lora_adapter: a PEFT directory on the schedulers' disks,
    served as `model` = `lora_name` once every scheduler has read and checked it."""

    lora_name: LoraName
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's and SGLang's /unload_lora_adapter (running requests under it finish first)."""

    lora_name: LoraName


def check_model(asked: str | None, served: str, adapters: Sequence[str] = ()) -> str | None:
    """The LoRA adapter `asked` names (None: the base model); a 404 naming it when it is
    neither the base nor one of `adapters` (--lora-paths)."""
    if not asked or asked == served:
        return None
    if asked in adapters:
        return asked
    also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}" if adapters else ""
    raise APIError(f"The model `{asked}` does not exist; this server serves `{served}`{also}",
                   "model", 404, code="model_not_found")


def sequences(rid: str, gateway_id: str, prompts: list[dict], params: SamplingParams, n: int,
              priority: int, cache_salt: str | None = None,
              lora_name: str | None = None) -> list[GenerateReq]:
    """What the engine generates for a request: n choices of each prompt, each its own rid."""
    msgs = []
    total = len(prompts) * n
    for i, prompt in enumerate(prompts):
        for j in range(n):
            p = msgspec.structs.replace(params)
            if p.seed is not None and n > 1:
                p.seed = p.seed + j  # distinct but reproducible choices
            sub_rid = rid if total == 1 else f"{rid}-{i * n + j}"
            msgs.append(GenerateReq(rid=sub_rid, gateway_id=gateway_id, params=p,
                                    priority=priority, arrival_time=time.time(),
                                    cache_salt=cache_salt, lora_name=lora_name, **prompt))
    return msgs


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_KEY_PATH = re.compile(r"at `key` in `\$\.?([^`]*)`")  # a bad key of an object, e.g. metadata
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
# what clients written for vLLM or older OpenAI APIs send, and the field that does it here
_RENAMED = {
    "guided_json": "structured_outputs.json or response_format",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "functions": "tools",
    "function_call": "tool_choice",
}


def _unknown_field(name: str, within: str | None, kind: type) -> APIError:
    """A 400 for a field this server does not implement, named by its path in the body."""
    param = f"{within}.{name}" if within else name
    openai = within is None and issubclass(kind, _Sampling) and name in _RENAMED
    hint = f"; use {_RENAMED[name]}" if openai else ""
    return APIError(f"unknown field `{param}`: this server does not implement it{hint}", param)

_JSON_MARKS = b'"[]{}'
_NOT_JSON_MARKS = bytes(sorted(set(range(256)) - set(_JSON_MARKS)))
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deeply `body` nests arrays and objects, found without decoding it (a decoder would
    recurse that deep): vectorised, about 0.1 s for 8 MiB of brackets."""
    # Escaped backslashes first, so that every \" left is an escaped quote, not a string's end.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(unescaped.translate(None, _NOT_JSON_MARKS), np.uint8)
    if not marks.size:
        return 0
    steps = _DEPTH_STEP[marks]
    steps[np.cumsum(marks == ord('"'), dtype=np.int32) & 1 == 1] = 0  # brackets inside strings
    return max(0, int(steps.cumsum(dtype=np.int32).max()))


def check_json_depth(body: bytes) -> None:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(f"the body nests arrays and objects {depth} levels deep; at most "
                       f"{MAX_JSON_DEPTH} are allowed", None)


def decode_body(body: bytes, kind: type) -> Any:
    """JSON bytes -> Struct, with errors that name the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = _KEY_PATH.sub(lambda k: f"(a key) at `$.{k.group(1)}`", str(exc))
        m = _PATH.search(text)
        param = (m.group(1) or None) if m else None  # `$` itself: the body as a whole
        unknown = _UNKNOWN.match(text)
        if unknown:
            raise _unknown_field(unknown.group(1), param, kind) from None
        if param is None and "missing required field" in text:
            m2 = re.search(r"`([^`]+)`", text)
            param = m2.group(1) if m2 else None
        if param:
            raise APIError(f"invalid `{param}`: {_PATH.sub('', text).rstrip(' -')}",
                           param) from None
        raise APIError(f"invalid request: {text}", param) from None
    except UnicodeDecodeError as exc:  # msgspec decodes strings lazily: bad bytes surface here
        raise APIError(f"the body is not valid UTF-8: {exc}", None) from None
    except msgspec.DecodeError as exc:
        msg = str(exc)
        if "UTF-8" in msg or "utf-8" in msg:
            raise APIError(f"the body is not valid UTF-8: {msg}", None) from None
        raise APIError(f"the body is not valid JSON: {msg}", None) from None


# -- what the types cannot say: cross-field, vocabulary and --max-stop-strings checks ---------
def _field_errors(build, *args):
    """`build(*args)`, its APIFieldError a 400 naming the field."""
    try:
        return build(*args)
    except APIFieldError as exc:
        raise APIError(str(exc), exc.param) from None


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise APIError(message, param)


def _check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    """vLLM's refusal: a prompt's logprobs are a whole-body answer, not a stream's."""
    _check(prompt_logprobs is None or not stream,
           "prompt_logprobs is not available with stream: true", "prompt_logprobs")


def _stops(stop: str | list[str] | None, max_stops: int) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _check(len(stops) <= max_stops,
           f"too many stop strings: {len(stops)} (at most {max_stops})", "stop")
    _check(all(s != "" for s in stops), "stop strings must not be empty", "stop")
    return stops


def _logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        _check(0 <= tid < vocab_size, f"logit_bias token id {tid} is outside the vocabulary "
               f"[0, {vocab_size})", "logit_bias")
        bias[tid] = float(value)
    return bias


def _token_ids(ids: list, vocab_size: int) -> list[int]:
    for t in ids:
        if type(t) is not int:  # a bool is an int to Python, not to the tokenizer
            raise APIError(f"prompt token ids must be integers, got {t!r}", "prompt")
        _check(0 <= t < vocab_size,
               f"token id {t} is outside the vocabulary [0, {vocab_size})", "prompt")
    return list(ids)


def _sampling_params(src: _Sampling | GenerateSamplingParams, *,
                     constraint: StructuredOutputs | None, max_tokens: int | None,
                     min_tokens: int, max_tokens_param: str, logprobs: int | None,
                     vocab_size: int, max_stops: int) -> SamplingParams:
    """The fields every body shares, read by their common names; None is the default."""
    top_k = -1 if src.top_k is None else src.top_k
    _check(top_k != 0, f"top_k must be -1 (off) or >= 1, got {top_k}", "top_k")
    if max_tokens is not None:
        _check(min_tokens <= max_tokens, f"min_tokens ({min_tokens}) must not exceed "
               f"{max_tokens_param} ({max_tokens})", "min_tokens")
    bias = _logit_bias(src.logit_bias, vocab_size)
    for tid in src.stop_token_ids or []:
        _check(tid < vocab_size, f"stop_token_ids: {tid} is outside the vocabulary",
               "stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        temperature=1.0 if src.temperature is None else src.temperature,
        top_p=1.0 if src.top_p is None else src.top_p,
        top_k=top_k,
        min_p=0.0 if src.min_p is None else src.min_p,
        seed=src.seed,
        presence_penalty=src.presence_penalty or 0.0,
        frequency_penalty=src.frequency_penalty or 0.0,
        repetition_penalty=1.0 if src.repetition_penalty is None else src.repetition_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        stop=_stops(src.stop, max_stops),
        stop_token_ids=list(src.stop_token_ids or []),
        ignore_eos=src.ignore_eos,
        skip_special_tokens=src.skip_special_tokens,
        include_stop_str_in_output=src.include_stop_str_in_output,
        structured_outputs=constraint,
    )
