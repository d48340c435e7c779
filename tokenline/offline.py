"""Offline batch inference: `Engine(...).generate(prompts)` drives the engine core in-process.

    from tokenline import Engine
    from common.messages import SamplingParams

    engine = Engine(max_total_tokens=20000)
    outs = engine.generate(["The capital of France is", [1, 504, 3458]],
                           SamplingParams(max_new_tokens=32, temperature=0))
    print(outs[0].text)

    engine = Engine(lora_paths={"pirate": "/path/to/peft/dir"})    # or ["pirate=/path/..."]
    outs = engine.generate(["Hello", "Hello"], lora_name=["pirate", None])  # None: the base

No NATS and no services: the same `EngineCore` the scheduler service runs, stepped in a loop
until every request is done. Requests finish out of order inside; results come back in input
order. Text is decoded as the outputs come, by the same incremental decoder the detokenizer
service runs (`common/incremental.py`), so it equals what the server returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from common.config import ServerArgs, check_device
from common.incremental import IncrementalText
from common.messages import AbortReq, SamplingParams, TokenizedReq, TokenOut

# vLLM's and OpenAI's default when nothing is asked for: a short completion, not the context.
DEFAULT_MAX_TOKENS = 16
# OpenAI / vLLM spellings accepted in a sampling-params dict.
_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}

Prompt = str | list[int] | dict[str, Any]


@dataclass
class Output:
    """One request's result. Times are `time.perf_counter()` seconds."""

    index: int  # position in the input list
    prompt: str | None  # the text prompt, None for token ids
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort or error
    matched_stop: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from submission to the last token."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class Engine:
    """The engine core in this process. `engine_flags` are `ServerArgs` fields, e.g.
    `max_total_tokens=20000, batching="static", chunked_prefill_size=256`; `lora_paths` may
    be a dict name -> PEFT directory."""

    def __init__(self, model: str | None = None, **engine_flags: Any) -> None:
        if isinstance(engine_flags.get("lora_paths"), dict):
            engine_flags["lora_paths"] = [f"{n}={p}" for n, p in engine_flags["lora_paths"].items()]
        self.args = _server_args(model, engine_flags)
        from services.scheduler.core.engine import EngineCore  # torch loads here, not on import

        self.core = EngineCore(self.args)
        self._chat = None
        self._batches = itertools.count()

    @property
    def tokenizer(self):
        """The model's `tokenizers.Tokenizer`."""
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
        lora_name: str | None | Sequence[str | None] = None,
    ) -> list[Output]:
        """Run every prompt to completion; results in input order.

        A prompt is a string (tokenized with the model's tokenizer), a list of token ids, or a
        dict with `prompt` or `prompt_token_ids`. One prompt may be passed bare. A request the
        engine rejects (say, longer than the context) comes back with finish_reason "error".
        `lora_name`: the LoRA adapter every prompt runs under, or one per prompt (None: the
        base); a name not served is a ValueError naming it.
        """
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items))
        loras = self._loras(lora_name, len(items))
        batch = next(self._batches)
        outputs = []
        for i, item in enumerate(items):
            text, ids = self._encode(item, i)
            outputs.append(Output(index=i, prompt=text, prompt_token_ids=ids,
                                  prompt_tokens=len(ids)))
        return self._run(outputs, params, loras, f"offline-{batch}-", use_tqdm)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve one more PEFT adapter (needs `enable_lora=True` or `lora_paths`); a
        ValueError names what is wrong with it."""
        reply = self.core.load_lora(lora_name, str(lora_path))
        if reply.status != 200:
            raise ValueError(reply.message)

    def unload_lora_adapter(self, lora_name: str) -> None:
        reply = self.core.unload_lora(lora_name)  # nothing runs between two generate calls
        if reply.status != 200:
            raise ValueError(reply.message)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        lora_name: str | None | Sequence[str | None] = None,
    ) -> list[Output]:
        """Like `generate`, for conversations rendered with the model's chat template; `tools`
        (OpenAI's shape) are rendered in the `tool_call_parser` format (`common.tool_calls`
        parses the replies)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self._chat is None:
            from services.tokenizer.tokenize import TextTokenizer

            self._chat = TextTokenizer(self.core.info)
        prompts = [
            {"prompt_token_ids": self._chat.encode_chat(list(c), add_generation_prompt, tools,
                                                        self.args.tool_call_parser)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_name)

    # -- inside ---------------------------------------------------------------------------------
    def _encode(self, item: Prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                item = list(item["prompt_token_ids"])
            elif "prompt" in item:
                item = item["prompt"]
            else:
                raise ValueError(f"prompts[{i}]: a dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(item, str):
            return item, self.tokenizer.encode(item, add_special_tokens=True).ids
        if isinstance(item, list) and all(isinstance(t, int) for t in item):
            return None, item
        raise TypeError(f"prompts[{i}] must be a string or a list of token ids, not "
                        f"{type(item).__name__}")

    def _loras(self, lora_name: str | None | Sequence[str | None], n: int) -> list[str | None]:
        names = [lora_name] * n if lora_name is None or isinstance(lora_name, str) \
            else list(lora_name)
        if len(names) != n:
            raise ValueError(f"{len(names)} lora_name values for {n} prompts: pass one, or "
                             "one each")
        for name in set(names):
            if (why := self.core.loras.refusal(name)) is not None:
                raise ValueError(f"lora_name: {why}")
        return names

    def _run(self, outputs: list[Output], params: list[SamplingParams],
             loras: list[str | None], tag: str, use_tqdm: bool) -> list[Output]:
        from tqdm.auto import tqdm

        by_rid = {f"{tag}{o.index}": o for o in outputs}
        texts: dict[str, IncrementalText] = {}
        now = time.perf_counter()
        for (rid, out), p, lora in zip(by_rid.items(), params, loras, strict=True):
            out.arrival_time = now
            texts[rid] = IncrementalText(self.tokenizer, p.stop, p.skip_special_tokens,
                                         p.include_stop_str_in_output)
            self.core.submit(TokenizedReq(rid=rid, gateway_id="offline",
                                          input_ids=out.prompt_token_ids, params=p,
                                          lora_name=lora))
        pending = set(by_rid)
        generated = 0
        bar = tqdm(total=len(outputs), desc="Generating", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while pending and self.core.has_work():
                step_outs = self.core.step()
                now = time.perf_counter()
                for msg in step_outs:
                    out = by_rid.get(msg.rid)
                    if out is None:
                        continue  # another generate call's leftovers cannot happen; be safe
                    generated += len(msg.token_ids)
                    if self._absorb(out, msg, now, texts[msg.rid]):
                        pending.discard(msg.rid)
                        bar.update(1)
                if step_outs and use_tqdm:
                    rate = generated / max(now - outputs[0].arrival_time, 1e-9)
                    bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        except BaseException:
            self._abort_pending(pending)
            raise
        finally:
            bar.close()
        if pending:  # the engine went idle with requests unanswered: a bug, say so loudly
            raise RuntimeError(f"engine idle with {len(pending)} requests unfinished")
        return outputs

    def _absorb(self, out: Output, msg: TokenOut, now: float, text: IncrementalText) -> bool:
        """Fold one step's output into `out`; True when the request is done."""
        if msg.token_ids and out.first_token_time is None:
            out.first_token_time = now
        out.token_ids += msg.token_ids
        out.cached_tokens = msg.cached_tokens
        if msg.prompt_tokens:
            out.prompt_tokens = msg.prompt_tokens
        text.push(msg.token_ids)
        out.text += text.take_output(msg.finish)
        if msg.finish is None:
            return False
        out.finish_time = now
        out.finish_reason = msg.finish.kind
        out.matched_stop = msg.finish.matched
        if msg.finish.kind in ("error", "abort"):
            out.error = msg.finish.message
        return True

    def _abort_pending(self, pending: set[str]) -> None:
        """Interrupted: abort what is left and run the engine dry, so it stays usable."""
        for rid in pending:
            self.core.abort(AbortReq(rid=rid, reason="generate interrupted"))
        while self.core.has_work():
            self.core.step()


def _server_args(model: str | None, flags: dict[str, Any]) -> ServerArgs:
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    unknown = sorted(set(flags) - set(fields))
    if unknown:
        raise TypeError(f"unknown engine flag(s) {unknown}; see `tokenline serve --help`")
    for name, value in flags.items():
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices and not (value is None and fields[name].default
                                                      is None):
            raise ValueError(f"{name}={value!r}: choose one of {choices}")
        if fields[name].metadata.get("type") == "device":
            try:
                check_device(value)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{name}: {exc}") from None
    return ServerArgs(model=model, **flags)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt of token ids
    return items


def _as_params_list(
    params: SamplingParams | dict | Sequence[SamplingParams | dict] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(max_new_tokens=DEFAULT_MAX_TOKENS)] * n
    if isinstance(params, SamplingParams | dict):
        return [_as_params(params)] * n
    out = [_as_params(p) for p in params]
    if len(out) != n:
        raise ValueError(f"{len(out)} sampling params for {n} prompts: pass one, or one each")
    return out


def _as_params(p: SamplingParams | dict) -> SamplingParams:
    if isinstance(p, SamplingParams):
        return p
    known = set(SamplingParams.__struct_fields__)
    d = {_ALIASES.get(k, k): v for k, v in p.items()}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}")
    d.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    try:
        return msgspec.convert(d, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad sampling parameters: {exc}") from exc
