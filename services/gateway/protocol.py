"""HTTP request bodies (msgspec Structs) and their checks, turned into SamplingParams.

Unknown fields are ignored, as vLLM does. Every error names the field it is about.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from common.messages import SamplingParams

MAX_N = 16  # most choices (and most prompts) per request
MAX_LOGPROBS = 20

# The ranges live in the types: msgspec checks them while decoding (the error names the field)
# and /openapi.json documents them. Every integer crosses NATS as msgpack int64, so none may be
# larger: a client's 2**70 is a 400, not a crash.
Int = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NonNeg = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Positive = Annotated[int, Meta(ge=1, le=2**63 - 1)]
TopK = Annotated[int, Meta(ge=-1, le=2**63 - 1, description="-1 (off) or >= 1")]
N = Annotated[int, Meta(ge=1, le=MAX_N)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Temperature = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
Bias = Annotated[float, Meta(ge=-100, le=100)]


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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
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


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[Any]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked later)
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: str | None = None


class GenerateSamplingParams(msgspec.Struct, kw_only=True):
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


class GenerateRequest(msgspec.Struct, kw_only=True):
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


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, kind: type) -> Any:
    """JSON bytes -> Struct, with errors that name the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        param = (m.group(1) or None) if m else None  # `$` itself: the body as a whole
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


def _stops(stop: str | list[str] | None, max_stops: int) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > max_stops:
        raise APIError(f"too many stop strings: {len(stops)} (at most {max_stops})", "stop")
    if any(s == "" for s in stops):
        raise APIError("stop strings must not be empty", "stop")
    return stops


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise APIError(message, param)


def build_params(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    presence_penalty: float | None,
    frequency_penalty: float | None,
    repetition_penalty: float | None,
    logit_bias: dict[str, float] | None,
    stop: str | list[str] | None,
    stop_token_ids: list[int] | None,
    ignore_eos: bool,
    min_tokens: int,
    skip_special_tokens: bool,
    include_stop_str_in_output: bool,
    logprobs: int | None,
    vocab_size: int,
    max_stops: int,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    t = 1.0 if temperature is None else temperature
    _check(t >= 0, f"temperature must be >= 0, got {t}", "temperature")
    p = 1.0 if top_p is None else top_p
    _check(0 < p <= 1, f"top_p must be in (0, 1], got {p}", "top_p")
    k = -1 if top_k is None else top_k
    _check(k == -1 or k >= 1, f"top_k must be -1 (off) or >= 1, got {k}", "top_k")
    mp = 0.0 if min_p is None else min_p
    _check(0 <= mp <= 1, f"min_p must be in [0, 1], got {mp}", "min_p")
    if max_tokens is not None:
        _check(max_tokens >= 1, f"{max_tokens_param} must be >= 1, got {max_tokens}",
               max_tokens_param)
    _check(min_tokens >= 0, f"min_tokens must be >= 0, got {min_tokens}", "min_tokens")
    if max_tokens is not None:
        _check(min_tokens <= max_tokens, f"min_tokens ({min_tokens}) must not exceed "
               f"{max_tokens_param} ({max_tokens})", "min_tokens")
    pp = presence_penalty or 0.0
    fp = frequency_penalty or 0.0
    _check(-2 <= pp <= 2, f"presence_penalty must be in [-2, 2], got {pp}", "presence_penalty")
    _check(-2 <= fp <= 2, f"frequency_penalty must be in [-2, 2], got {fp}", "frequency_penalty")
    rp = 1.0 if repetition_penalty is None else repetition_penalty
    _check(0 < rp <= 10, f"repetition_penalty must be in (0, 10], got {rp}",
           "repetition_penalty")
    if seed is not None:
        _check(-(2**63) <= seed < 2**63, "seed must fit in 64 bits", "seed")
    bias: dict[int, float] | None = None
    if logit_bias:
        bias = {}
        for key, value in logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise APIError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            _check(0 <= tid < vocab_size, f"logit_bias token id {tid} is outside the vocabulary "
                   f"[0, {vocab_size})", "logit_bias")
            _check(-100 <= value <= 100, f"logit_bias values must be in [-100, 100], got {value}",
                   "logit_bias")
            bias[tid] = float(value)
    for tid in stop_token_ids or []:
        _check(0 <= tid < vocab_size, f"stop_token_ids: {tid} is outside the vocabulary",
               "stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        temperature=t,
        top_p=p,
        top_k=k,
        min_p=mp,
        seed=seed,
        presence_penalty=pp,
        frequency_penalty=fp,
        repetition_penalty=rp,
        logit_bias=bias,
        logprobs=logprobs,
        stop=_stops(stop, max_stops),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )
