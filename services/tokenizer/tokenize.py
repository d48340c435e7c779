"""Chat templates and tokenization with the `tokenizers` package (no torch, starts fast)."""

from __future__ import annotations

from datetime import datetime

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.modelstore import ModelInfo

ROLES = {"system", "user", "assistant", "tool", "developer"}


class InputError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


NO_TEMPLATE = ("this model has no chat template: use /v1/completions or /generate, or start "
               "the server with --chat-template FILE")


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

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
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
                m = {**m, "content": "".join(parts)}
            elif content is None:
                m = {**m, "content": ""}
            elif not isinstance(content, str):
                raise InputError(f"messages[{i}].content must be a string or a list of parts",
                                 f"messages[{i}].content")
            messages[i] = m
        if self.template is None:
            raise InputError(NO_TEMPLATE, "messages")
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.info.bos_token or "",
                eos_token=self.info.eos_token or "",
            )
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - odd messages break templates in odd ways
            raise InputError(f"chat template failed: {exc}", "messages") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        # The template writes the special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=False).ids
