"""Chat templates and tokenization with the `tokenizers` package (no torch, starts fast)."""

from __future__ import annotations

from datetime import datetime

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common import tool_calls
from common.modelstore import ModelInfo

ROLES = {"system", "user", "assistant", "tool", "developer"}


class InputError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


NO_TEMPLATE = ("this model has no chat template: use /v1/completions or /generate, or start "
               "the server with --chat-template FILE")


def _text_content(m: dict, i: int) -> dict:
    """messages[i] with its content as one string (OpenAI's text parts joined)."""
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InputError(
                    f"messages[{i}].content: only text parts are supported",
                    f"messages[{i}].content",
                )
            parts.append(str(part.get("text", "")))
        return {**m, "content": "".join(parts)}
    if content is None:
        return {**m, "content": ""}
    if not isinstance(content, str):
        raise InputError(f"messages[{i}].content must be a string or a list of parts",
                         f"messages[{i}].content")
    return m


def _raise(message: str) -> None:
    raise InputError(message, "messages")


class TextTokenizer:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.tokenizer = Tokenizer.from_file(str(info.tokenizer_json))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(info.chat_template) if info.chat_template else None
        # A template that renders tools itself gets them as they are; else the tool-call
        # format's system prompt and the assistant's calls written in that format stand in.
        source = info.chat_template or ""
        self.template_tools = "tools" in source
        self.template_tool_calls = "tool_calls" in source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, tool_format: str = "xlam") -> str:
        if not messages:
            raise InputError("messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InputError(f"messages[{i}] must be an object", f"messages[{i}]")
            if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
                raise InputError(
                    f"messages[{i}].role {m.get('role')!r} is not one of {sorted(ROLES)}",
                    f"messages[{i}].role",
                )
            m = _text_content(m, i)
            if m.get("tool_calls") is not None:
                m = self._with_tool_calls(m, i, tool_format)
            messages[i] = m
        if tools and not self.template_tools:
            prompt = tool_calls.system_prompt(tool_format, tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        if self.template is None:
            raise InputError(NO_TEMPLATE, "messages")
        try:
            extra = {"tools": tools} if tools and self.template_tools else {}
            return self.template.render(
                **extra,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.info.bos_token or "",
                eos_token=self.info.eos_token or "",
            )
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - odd messages break templates in odd ways
            raise InputError(f"chat template failed: {exc}", "messages") from exc

    def _with_tool_calls(self, m: dict, i: int, tool_format: str) -> dict:
        """An assistant message's earlier tool calls: checked, and written into its content
        in the tool-call format unless the template renders `tool_calls` itself."""
        calls = m["tool_calls"]
        param = f"messages[{i}].tool_calls"
        if m["role"] != "assistant":
            raise InputError(f"{param}: only assistant messages carry tool_calls", param)
        if not isinstance(calls, list):
            raise InputError(f"{param} must be a list", param)
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", "{}"), str | dict):
                raise InputError(f"{param}[{j}] must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"arguments\": ...}}", f"{param}[{j}]")
        if self.template_tool_calls:
            return m
        text = tool_calls.render_calls(tool_format, calls)
        content = m["content"]
        return {k: v for k, v in m.items() if k != "tool_calls"} | {
            "content": f"{content}\n{text}" if content else text}

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, tool_format: str = "xlam",
                    add_special_tokens: bool = False) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, tools, tool_format)
        # The template writes the special tokens itself (more only when /tokenize asks).
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's piece of the vocabulary as it stands there (`Ġworld`), as transformers'
        convert_ids_to_tokens gives it; an id the vocabulary lacks is an empty string."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]
