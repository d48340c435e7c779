"""Write the fixed benchmark workloads next to this script.

    python bench/workloads/make_workloads.py

- mixed64.jsonl: 64 requests, prompt lengths uniform in [32, 512], outputs uniform in
  [16, 256]: a mix of short and long prefills and decodes for continuous batching.
  Totals: 18,685 prompt tokens, 7,729 output tokens.
- shared_prefix32.jsonl: 32 requests that share one 1,500-token system prompt, followed by a
  distinct 8-24 token question, 16 output tokens each: what the prefix cache is for.
  Totals: 48,507 prompt tokens (1,500 of each request shared), 512 output tokens.
- grounded12.jsonl: 12 text prompts whose answer is mostly in the prompt (a paragraph to
  copy, code to repeat with one name changed, a JSON record to repeat without a field), 96
  output tokens each: what speculative decoding's n-gram drafts are for. Text, not token ids,
  so every server tokenizes the same prompts its own way (`bench peers`).
- multiturn32x6.jsonl: 32 conversations of 6 turns behind one shared 1,024-token system
  prompt; each turn adds a 24-64 token user message and asks for a 32-token answer, and
  re-sends the whole history (`tokenline bench serve --dataset-name conversations`).
  Totals: see the file's first line.

Prompts are token ids from [1000, 40000), ordinary tokens of SmolLM2's 49,152-token
vocabulary, so no tokenizer is needed and every run sends the very same tokens. Send them
with ignore_eos (`tokenline bench serve --ignore-eos`) so each request generates exactly
its max_tokens and runs are comparable. The first line of each file is a `#` comment with
its totals; `bench.datasets.load_jsonl` skips it.

The long-context and shared-document workloads (shared-doc, long-2k, long-4k, long-7k,
long-mixed, multiturn-long) are not files: `bench/long_workloads.py` generates them from a seed
when `tokenline bench peers --workload NAME` (or `--suite long`) asks for them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOKEN_LOW, TOKEN_HIGH = 1000, 40000
SEED = 0


def mixed(rng: np.random.Generator, n: int = 64) -> list[dict]:
    rows = []
    for _ in range(n):
        prompt_len = int(rng.integers(32, 512, endpoint=True))
        max_tokens = int(rng.integers(16, 256, endpoint=True))
        ids = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=prompt_len).tolist()
        rows.append({"prompt_token_ids": ids, "max_tokens": max_tokens})
    return rows


def shared_prefix(
    rng: np.random.Generator, n: int = 32, prefix_len: int = 1500, max_tokens: int = 16
) -> list[dict]:
    system = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=prefix_len).tolist()
    rows = []
    for _ in range(n):
        question = rng.integers(
            TOKEN_LOW, TOKEN_HIGH, size=int(rng.integers(8, 24, endpoint=True))
        ).tolist()
        rows.append({"prompt_token_ids": system + question, "max_tokens": max_tokens})
    return rows


def multiturn(rng: np.random.Generator, conversations: int = 32, turns: int = 6,
              system_len: int = 1024, answer_len: int = 32) -> list[dict]:
    """One system-prompt row, then one row per conversation (`bench.datasets.load_conversations`
    builds each turn's prompt from them, so the file stays small)."""
    def ids(n: int) -> list[int]:
        return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()

    rows: list[dict] = [{"system_prompt_token_ids": ids(system_len)}]
    for _ in range(conversations):
        rows.append({"turns": [{"user_token_ids": ids(int(rng.integers(24, 64, endpoint=True))),
                                "answer_token_ids": ids(answer_len)} for _ in range(turns)]})
    return rows


CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
"""

RECORD = {"name": "Ada Lovelace", "born": 1815, "city": "London",
          "known_for": "the first published algorithm", "languages": ["English", "French"]}


def grounded(paragraphs: list[str]) -> list[dict]:
    """Copying, editing and filling in: each prompt holds most of its answer."""
    rows = []
    for p in paragraphs[:4]:
        rows.append({"prompt": f"Text: {p}\n\nCopy the text above exactly.\nCopy: ",
                     "max_tokens": 96})
    for old, new in (("values", "xs"), ("total", "acc"), ("value", "x"), ("mean", "average")):
        rows.append({"prompt": f"```python\n{CODE}```\nThe same code with `{old}` renamed "
                               f"to `{new}`:\n```python\n", "max_tokens": 96})
    for field in ("city", "born", "known_for", "languages"):
        partial = {k: v for k, v in RECORD.items() if k != field}
        rows.append({"prompt": f"Record: {json.dumps(RECORD)}\nThe record without its "
                               f"`{field}` field, as JSON: {json.dumps(partial)[:20]}",
                     "max_tokens": 96})
    return rows


def write_text(path: Path, rows: list[dict], what: str) -> str:
    chars = sum(len(r["prompt"]) for r in rows)
    output = sum(r["max_tokens"] for r in rows)
    return _write(path, rows, f"{what}; {len(rows)} requests, {chars} prompt characters, "
                  f"{output} output tokens")


def write_conversations(path: Path, rows: list[dict], what: str) -> str:
    system = rows[0]["system_prompt_token_ids"]
    prompt = output = requests = 0
    for row in rows[1:]:
        history = len(system)
        for turn in row["turns"]:
            history += len(turn["user_token_ids"])
            prompt += history
            output += len(turn["answer_token_ids"])
            history += len(turn["answer_token_ids"])
            requests += 1
    return _write(path, rows, f"{what}; {len(rows) - 1} conversations, {requests} requests, "
                  f"{prompt} prompt tokens, {output} output tokens")


def write(path: Path, rows: list[dict], what: str) -> str:
    prompt = sum(len(r["prompt_token_ids"]) for r in rows)
    output = sum(r["max_tokens"] for r in rows)
    return _write(path, rows, f"{what}; {len(rows)} requests, {prompt} prompt tokens, {output} "
                  "output tokens")


def _write(path: Path, rows: list[dict], what: str) -> str:
    header = f"# {what} (send with ignore_eos); made by make_workloads.py, seed {SEED}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(header + "\n")
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return header


def main() -> None:
    # One generator per file, so that changing one workload never changes the other.
    print(write(HERE / "mixed64.jsonl", mixed(np.random.default_rng(SEED)),
                "prompts uniform in [32, 512] tokens, outputs uniform in [16, 256]"))
    print(write(HERE / "shared_prefix32.jsonl", shared_prefix(np.random.default_rng(SEED)),
                "one shared 1500-token system prompt + an 8-24 token question, 16 out"))
    texts = (HERE.parent / "texts" / "declaration_gettysburg.txt").read_text().split("\n\n")
    paragraphs = [t.strip() for t in texts if 300 <= len(t.strip()) <= 900]
    print(write_text(HERE / "grounded12.jsonl", grounded(paragraphs),
                     "paragraphs to copy, code to repeat renamed, JSON to fill, 96 out"))
    print(write_conversations(HERE / "multiturn32x6.jsonl", multiturn(np.random.default_rng(SEED)),
                              "1024-token shared system prompt, 6 turns of 24-64 user + 32 "
                              "answer tokens, whole history re-sent"))


if __name__ == "__main__":
    main()
