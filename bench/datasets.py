"""Request sources of the serving benchmark: random token ids, JSONL files, ShareGPT dumps.

Every loader returns `SampleRequest`s. A prompt is either text or a list of token ids;
/v1/completions takes both (as OpenAI does), so token-id prompts reach the model exactly
as written, with no tokenizer on the client.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Token ids below this are where Llama-family vocabularies keep special and byte tokens;
# random prompts stay above it so that they read as ordinary text to the model.
RANDOM_TOKEN_LOW = 1000
# ShareGPT has no token counts; ~1.3 tokens per English word is the usual BPE ratio.
TOKENS_PER_WORD = 1.3


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens; an estimate for text prompts (the server's usage overrides it)
    max_tokens: int
    # Turns of one conversation share an id and go in order, each after the previous answered.
    conversation: int | None = None
    model: str | None = None  # sent as this request's `model` (e.g. a LoRA adapter's name)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random token ids; lengths uniform in [len*(1-r), len*(1+r)] as in vLLM."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    low_id = min(RANDOM_TOKEN_LOW, vocab_size // 2)
    in_lens = rng.integers(
        max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio)) + 1,
        size=num_prompts,
    )
    out_lens = rng.integers(
        max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)) + 1,
        size=num_prompts,
    )
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        ids = rng.integers(low_id, vocab_size, size=int(n_in)).tolist()
        requests.append(SampleRequest(prompt=ids, prompt_len=int(n_in), max_tokens=int(n_out)))
    return requests


def load_jsonl(path: str | Path, num_prompts: int | None = None) -> list[SampleRequest]:
    """One request per line: `prompt` (str) or `prompt_token_ids` (list of int), `max_tokens`.

    Lines starting with `#` are comments (our workload files describe themselves there).
    """
    requests: list[SampleRequest] = []
    for where, row in _rows(path):
        if "max_tokens" not in row:
            raise ValueError(f"{where}: missing max_tokens")
        if "prompt_token_ids" in row:
            ids = row["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a list of int")
            req = SampleRequest(prompt=ids, prompt_len=len(ids), max_tokens=row["max_tokens"])
        elif isinstance(row.get("prompt"), str):
            text = row["prompt"]
            req = SampleRequest(
                prompt=text, prompt_len=_estimate_tokens(text), max_tokens=row["max_tokens"]
            )
        else:
            raise ValueError(f"{where}: needs prompt (str) or prompt_token_ids")
        requests.append(req)
        if num_prompts is not None and len(requests) >= num_prompts:
            break
    return requests


def load_conversations(path: str | Path, num_conversations: int | None = None,
                       ) -> list[SampleRequest]:
    """Multi-turn conversations, each turn re-sending the whole history, as token ids.

    The file (see `bench/workloads/make_workloads.py`) holds a shared system prompt once,
    `{"system_prompt_token_ids": [...]}`, then one conversation per line:
    `{"turns": [{"user_token_ids": [...], "answer_token_ids": [...]}, ...]}`. Turn t's prompt
    is system + (user, answer) of every earlier turn + its own user part; it asks for
    len(answer) tokens. The next turn carries the file's answer, not the model's: the history
    is the same in every run, and the prefix a turn can find cached is its previous prompt.
    """
    system: list[int] | None = None
    requests: list[SampleRequest] = []
    conversations = 0
    for where, row in _rows(path):
        if "system_prompt_token_ids" in row:
            system = list(row["system_prompt_token_ids"])
            continue
        if system is None or not row.get("turns"):
            raise ValueError(f"{where}: expected the system prompt line first, then lines "
                             "with turns")
        turns = [(t["user_token_ids"], t["answer_token_ids"]) for t in row["turns"]]
        requests += conversation_requests(system, turns, conversations)
        conversations += 1
        if num_conversations is not None and conversations >= num_conversations:
            break
    return requests


def conversation_requests(system: list[int], turns: list[tuple[list[int], list[int]]],
                          conversation: int) -> list[SampleRequest]:
    """One conversation's requests: turn t's prompt is system + (user, answer) of every
    earlier turn + its own user part, and it asks for len(answer) tokens."""
    requests = []
    history = list(system)
    for user, answer in turns:
        prompt = history + list(user)
        requests.append(SampleRequest(prompt, len(prompt), len(answer), conversation))
        history = prompt + list(answer)
    return requests


def _rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(file:line, object) for each JSON line; `#` lines are comments (our workload files
    describe themselves there)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                yield f"{path}:{lineno}", json.loads(line)


def load_sharegpt(
    path: str | Path,
    num_prompts: int | None = None,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """First human turn as prompt, the gpt reply's length (words x 1.3) as max_tokens.

    Conversations are shuffled with `seed` (ShareGPT dumps are ordered by source) and those
    without a human-then-gpt opening are skipped. `output_len` caps max_tokens.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    requests: list[SampleRequest] = []
    for i in order:
        turns = data[i].get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = turns[0].get("value") or "", turns[1].get("value") or ""
        if not prompt.strip():
            continue
        n_out = max(1, _estimate_tokens(reply))
        if output_len is not None:
            n_out = min(n_out, output_len)
        requests.append(
            SampleRequest(prompt=prompt, prompt_len=_estimate_tokens(prompt), max_tokens=n_out)
        )
        if num_prompts is not None and len(requests) >= num_prompts:
            break
    return requests


def _estimate_tokens(text: str) -> int:
    return round(len(text.split()) * TOKENS_PER_WORD)
