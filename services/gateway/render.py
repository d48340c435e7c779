"""Response bodies, one renderer per API: OpenAI chat, OpenAI completions, SGLang /generate.

`GatewayService._run` drives any of them: `chunk` for each output while streaming (None: nothing
to send), `tail` after the last one, or `final` for the whole body when not streaming.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from common.messages import Finish, LogprobOut, TextOut
from services.gateway import constraints
from services.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from services.gateway.tracker import SubRequest

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens kept


def decoder(tokenizer_json: Path) -> Decode:
    """Token text for logprobs and echo; the tokenizer loads on first use."""
    loaded = []

    def decode(ids: list[int]) -> str:
        if not loaded:
            from tokenizers import Tokenizer

            loaded.append(Tokenizer.from_file(str(tokenizer_json)))
        return loaded[0].decode(ids, skip_special_tokens=False)

    return decode


def usage(subs: list[SubRequest]) -> dict:
    seen: set[str] = set()
    prompt = cached = 0
    for s in subs:  # a prompt shared by n choices counts once
        key = s.msg.text if s.msg.text is not None else repr(s.msg.messages or s.msg.input_ids)
        if key not in seen:
            seen.add(key)
            prompt += s.prompt_tokens
            cached += s.cached_tokens
    completion = sum(len(s.token_ids) for s in subs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(out: TextOut) -> str | None:
    return None if out.finish is None else out.finish.kind


def vllm_prompt_logprobs(lps: list[LogprobOut] | None, top_n: int,
                         token_str: Callable[[int], str]) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then for each prompt token a dict
    of token id -> {logprob, rank, decoded_token}: the token itself and the top_n likeliest."""
    if lps is None:
        return None
    out: list[dict | None] = [None]
    for lp in lps[1:]:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": token_str(lp.token_id)}}
        for rank, (tid, v) in enumerate(lp.top[:top_n], 1):
            entry.setdefault(str(tid), {"logprob": v, "rank": rank,
                                        "decoded_token": token_str(tid)})
        out.append(entry)
    return out


class Renderer:
    """What the three APIs share: the response id, the model's name, token text."""

    def __init__(self, rid: str, model: str, decode: Decode) -> None:
        self.rid = rid
        self.model = model
        self.decode = decode
        self.created = int(time.time())

    def chunk(self, sub: SubRequest, out: TextOut) -> dict | None:
        raise NotImplementedError

    def final(self, subs: list[SubRequest]) -> dict | list:
        raise NotImplementedError

    def tail(self, subs: list[SubRequest]) -> list[dict]:
        return []

    def with_usage(self, chunk: dict, subs: list[SubRequest]) -> dict:
        """A streamed chunk as sent (the usage so far added, where asked)."""
        return chunk

    def token_str(self, tid: int) -> str:
        return self.decode([tid])

    # how a stream is framed: OpenAI's and SGLang's `data:` lines, ending in `[DONE]`
    def sse(self, chunk: dict | list) -> bytes:
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def error_event(self, exc: APIError) -> bytes:
        return self.sse(exc.body())

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"


class _OpenAI(Renderer):
    """Chat and completions: one body shape, `stream_options.include_usage` at the end (and
    with `continuous_usage_stats` on every chunk: the whole request's usage so far, which for
    n = 1 is vLLM's per-choice count)."""

    obj = ""
    chunk_obj = ""

    def __init__(self, rid: str, model: str, decode: Decode,
                 req: ChatCompletionRequest | CompletionRequest) -> None:
        super().__init__(rid, model, decode)
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)

    def body(self, choices: list, usage: dict | None = None, obj: str | None = None) -> dict:
        d = {"id": self.rid, "object": obj or self.chunk_obj, "created": self.created,
             "model": self.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return d

    def tail(self, subs: list[SubRequest]) -> list[dict]:
        return [self.body([], usage(subs))] if self.include_usage else []

    def with_usage(self, chunk: dict, subs: list[SubRequest]) -> dict:
        if self.continuous_usage:
            chunk["usage"] = usage(subs)
        return chunk


class ChatRenderer(_OpenAI):
    chunk_obj = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, decode: Decode, req: ChatCompletionRequest) -> None:
        super().__init__(rid, model, decode, req)
        self.want_logprobs = req.logprobs
        self.prompt_top_n = req.prompt_logprobs
        self.sent_role: set[int] = set()
        _, self.tools, _ = req.tool_plan()
        self.tool_stream = constraints.ChatToolStream(self.tools) if self.tools else None

    def chunk(self, sub: SubRequest, out: TextOut) -> dict | None:
        delta: dict = {}
        if sub.index not in self.sent_role:  # the first chunk of each choice names the role
            self.sent_role.add(sub.index)
            delta = {"role": "assistant", "content": ""}
        reason = _finish_reason(out)
        if self.tool_stream is None:
            if out.text:
                delta["content"] = out.text
        else:
            reason = self.tool_stream.delta(sub.index, out.text, out.finish is not None, delta,
                                            reason)
        if not delta and not reason and not (self.want_logprobs and out.logprobs):
            return None
        return self.body([{"index": sub.index, "delta": delta,
                           "logprobs": self.logprobs(out.logprobs), "finish_reason": reason}])

    def final(self, subs: list[SubRequest]) -> dict:
        choices = []
        for s in subs:
            message, reason = constraints.message(s.text, self.tools, s.finish_reason)
            choices.append({"index": s.index, "message": message,
                            "logprobs": self.logprobs(s.all_logprobs), "finish_reason": reason})
        body = self.body(choices, usage(subs), obj="chat.completion")
        if self.prompt_top_n is not None:  # vLLM's place: the response's, the choices share it
            body["prompt_logprobs"] = vllm_prompt_logprobs(subs[0].prompt_logprobs,
                                                           self.prompt_top_n, self.token_str)
        return body

    def logprobs(self, lps: list[LogprobOut] | None) -> dict | None:
        if not self.want_logprobs or lps is None:
            return None
        content = []
        for lp in lps:
            tok = self.token_str(lp.token_id)
            content.append({
                "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self.token_str(i)), "logprob": v,
                                  "bytes": list(t.encode())} for i, v in lp.top],
            })
        return {"content": content}


class CompletionRenderer(_OpenAI):
    chunk_obj = "text_completion"

    def __init__(self, rid: str, model: str, decode: Decode, req: CompletionRequest) -> None:
        super().__init__(rid, model, decode, req)
        self.want_logprobs = req.logprobs is not None
        self.top_n = req.logprobs or 0
        self.prompt_top_n = req.prompt_logprobs
        self.echo = req.echo
        self.echo_done: set[int] = set()

    def echo_text(self, sub: SubRequest) -> str:
        if sub.msg.text is not None:
            return sub.msg.text
        return self.decode(sub.msg.input_ids or [])

    def chunk(self, sub: SubRequest, out: TextOut) -> dict | None:
        """With echo, a choice's first chunk starts with the prompt (and its logprobs), as
        vLLM streams it; its first output carries the prompt's logprobs."""
        text, prompt = out.text, None
        if self.echo and sub.index not in self.echo_done:
            self.echo_done.add(sub.index)
            text, prompt = self.echo_text(sub) + text, sub.prompt_logprobs
        reason = _finish_reason(out)
        if not text and not reason:
            return None
        return self.body([{"index": sub.index, "text": text,
                           "logprobs": self.logprobs(out.logprobs, prompt),
                           "finish_reason": reason}])

    def final(self, subs: list[SubRequest]) -> dict:
        choices = []
        for s in subs:
            choice = {"index": s.index, "text": (self.echo_text(s) if self.echo else "") + s.text,
                      "logprobs": self.logprobs(s.all_logprobs,
                                                s.prompt_logprobs if self.echo else None),
                      "finish_reason": s.finish_reason}
            if self.prompt_top_n is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    s.prompt_logprobs, self.prompt_top_n, self.token_str)
            choices.append(choice)
        return self.body(choices, usage(subs))

    def logprobs(self, lps: list[LogprobOut] | None,
                 prompt: list[LogprobOut] | None = None) -> dict | None:
        """OpenAI's legacy shape; echoed, the prompt's tokens come first (the first with a
        null logprob and null top_logprobs, as OpenAI gives it)."""
        if not self.want_logprobs or (lps is None and prompt is None):
            return None
        every = (prompt or []) + (lps or [])
        tokens = [self.token_str(lp.token_id) for lp in every]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        first = 1 if prompt else 0  # the prompt's first token: nothing precedes it
        return {"tokens": tokens,
                "token_logprobs": [None] * first + [lp.logprob for lp in every[first:]],
                "top_logprobs": [None] * first + [
                    {self.token_str(i): v for i, v in lp.top[:self.top_n]}
                    for lp in every[first:]],
                "text_offset": offsets}


def sglang_finish(fin: Finish) -> dict:
    """SGLang's shape: {"type": "stop", "matched": ...} / {"type": "length", "length": n}."""
    d: dict = {"type": fin.kind}
    if fin.matched is not None:
        d["matched"] = fin.matched
    if fin.message:
        d["message"] = fin.message
    return d


class GenerateRenderer(Renderer):
    """SGLang's /generate: every chunk carries the cumulative text and a `meta_info`."""

    def __init__(self, rid: str, model: str, decode: Decode, req: GenerateRequest) -> None:
        super().__init__(rid, model, decode)
        self.want_logprobs = req.return_logprob
        self.top_logprobs = req.top_logprobs_num
        self.prompt_from = req.logprob_start_len if req.return_logprob else -1

    def chunk(self, sub: SubRequest, out: TextOut) -> dict | None:
        if not out.text and out.finish is None:
            return None
        return self.one(sub)

    def final(self, subs: list[SubRequest]) -> dict | list:
        return self.one(subs[0]) if len(subs) == 1 else [self.one(s) for s in subs]

    def one(self, sub: SubRequest) -> dict:
        return {"text": sub.text, "output_ids": sub.token_ids, "index": sub.index,
                "meta_info": self.meta(sub)}

    def meta(self, sub: SubRequest) -> dict:
        fin = sub.finish
        m = {"id": sub.msg.rid, "prompt_tokens": sub.prompt_tokens,
             "completion_tokens": len(sub.token_ids), "cached_tokens": sub.cached_tokens,
             "finish_reason": None if fin is None else sglang_finish(fin),
             "e2e_latency": time.monotonic() - sub.arrival}
        if self.want_logprobs:
            m["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in sub.all_logprobs]
            if self.top_logprobs:
                m["output_top_logprobs"] = [[[v, t] for t, v in lp.top]
                                            for lp in sub.all_logprobs]
        if self.prompt_from >= 0 and sub.prompt_logprobs is not None:
            self.input_logprobs(m, sub.prompt_logprobs[self.prompt_from:], self.prompt_from)
        return m

    def input_logprobs(self, m: dict, lps: list[LogprobOut], start: int) -> None:
        """SGLang's input_token_logprobs from logprob_start_len on (the first token's null)."""
        m["input_token_logprobs"] = [[None if start + j == 0 else lp.logprob, lp.token_id]
                                     for j, lp in enumerate(lps)]
        if self.top_logprobs:
            m["input_top_logprobs"] = [None if start + j == 0 else [[v, t] for t, v in lp.top]
                                       for j, lp in enumerate(lps)]
