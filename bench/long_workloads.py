"""Named workloads for long contexts and shared documents, generated from a seed.

`tokenline bench peers --workload NAME` runs one, `--suite long` all of them (issue 45):

- shared-doc: 32 requests at once that share one 3,000-token document, each followed by a
  distinct 20-60-token question (they differ from the document's end on), 64 output tokens:
  one prefill of the document should serve every question.
- long-2k, long-4k: 16 requests of prompts uniform in [1950, 2050] / [3900, 4100] tokens,
  128 output tokens; long-7k: 8 requests of [6900, 7100]-token prompts, 128 output tokens.
  No two prompts share their first token, so no prefix (not even a KV block) is shared.
  long-7k has 8 requests, not 16, so that its requests fit our default KV pool at once
  (about 69k tokens in float32: 8 x 7,228 = 57.8k; long-4k takes at most 16 x 4,228 = 67.6k).
- long-mixed: 16 requests of prompts uniform in [2500, 4500] tokens, distinct from the first
  token, 128 output tokens.
- multiturn-long: 8 chats behind one shared 2,048-token system prompt, 6 turns each; a turn
  adds a 100-300-token user message and asks for a 128-token answer, re-sending the whole
  history (the workload's own answers, not the model's, as `bench.datasets.load_conversations`
  does). A chat's turns go one after another, the chats at once (`bench.serve` chains the
  requests of one `conversation`). The longest prompt is 2,048 + 6 x 300 + 5 x 128 = 4,488.

Each server warms up (its first forwards allocate) on `cold_warmup`'s request, which shares
no prefix with the workload: warming up on the workload's own first request would put
shared-doc's document (or multiturn-long's system prompt) in the prefix cache before the
burst, and the burst would measure a warm cache.

SmolLM2-135M's context is 8,192 tokens; every request's prompt + max_tokens stays under it.
Prompts are token ids from [1000, 40000), as in `bench/workloads/make_workloads.py`; send them
with ignore_eos (bench peers does) so that each request generates its max_tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bench.datasets import SampleRequest, conversation_requests

TOKEN_LOW, TOKEN_HIGH = 1000, 40000
CONTEXT = 8192  # SmolLM2-135M's (and vLLM's --max-model-len in bench peers)


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


def _distinct_firsts(rng: np.random.Generator, n: int) -> list[int]:
    """n different token ids: the first tokens of prompts (or questions) that share nothing."""
    return (rng.choice(TOKEN_HIGH - TOKEN_LOW, size=n, replace=False) + TOKEN_LOW).tolist()


def shared_doc(seed: int = 0, n: int = 32, doc_len: int = 3000,
               max_tokens: int = 64) -> list[SampleRequest]:
    """One document, then a distinct 20-60-token question per request."""
    rng = np.random.default_rng(seed)
    doc = _ids(rng, doc_len)
    requests = []
    for first in _distinct_firsts(rng, n):
        question = [first] + _ids(rng, int(rng.integers(20, 60, endpoint=True)) - 1)
        requests.append(SampleRequest(doc + question, doc_len + len(question), max_tokens))
    return requests


def distinct_prompts(seed: int, n: int, low: int, high: int,
                     max_tokens: int) -> list[SampleRequest]:
    """n prompts of lengths uniform in [low, high], no two with the same first token."""
    rng = np.random.default_rng(seed)
    requests = []
    for first in _distinct_firsts(rng, n):
        prompt = [first] + _ids(rng, int(rng.integers(low, high, endpoint=True)) - 1)
        requests.append(SampleRequest(prompt, len(prompt), max_tokens))
    return requests


def long_2k(seed: int = 0) -> list[SampleRequest]:
    return distinct_prompts(seed, 16, 1950, 2050, 128)


def long_4k(seed: int = 0) -> list[SampleRequest]:
    return distinct_prompts(seed, 16, 3900, 4100, 128)


def long_7k(seed: int = 0) -> list[SampleRequest]:
    """8 requests, not 16: all of them fit our default float32 KV pool (~69k tokens) at once."""
    return distinct_prompts(seed, 8, 6900, 7100, 128)


def long_mixed(seed: int = 0) -> list[SampleRequest]:
    return distinct_prompts(seed, 16, 2500, 4500, 128)


def multiturn_long(seed: int = 0, chats: int = 8, turns: int = 6, system_len: int = 2048,
                   answer_len: int = 128) -> list[SampleRequest]:
    """Chats behind one system prompt, each turn re-sending the history; chat by chat, turn
    by turn, each request's `conversation` its chat."""
    rng = np.random.default_rng(seed)
    system = _ids(rng, system_len)
    requests = []
    for chat, first in enumerate(_distinct_firsts(rng, chats)):
        users = [_ids(rng, int(rng.integers(100, 300, endpoint=True))) for _ in range(turns)]
        users[0][0] = first  # the chats part right after the system prompt
        requests += conversation_requests(
            system, [(user, _ids(rng, answer_len)) for user in users], chat)
    return requests


def cold_warmup(requests: list[SampleRequest]) -> SampleRequest:
    """The first request's prompt reversed, as long and asking as many tokens, and so sharing
    no KV block with any request of these workloads (their prompts are random)."""
    first = requests[0]
    return SampleRequest(list(reversed(first.prompt)), first.prompt_len, first.max_tokens)


WORKLOADS: dict[str, Callable[[int], list[SampleRequest]]] = {
    "shared-doc": shared_doc,
    "long-2k": long_2k,
    "long-4k": long_4k,
    "long-7k": long_7k,
    "long-mixed": long_mixed,
    "multiturn-long": multiturn_long,
}
SUITES: dict[str, list[str]] = {"long": list(WORKLOADS)}


def suite_workloads(text: str) -> list[str]:
    """A suite's workload names, or the names of a comma-separated list."""
    if text in SUITES:
        return SUITES[text]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"--suite: {', '.join(unknown) or 'nothing'}: not a suite "
                         f"({', '.join(SUITES)}) or workload ({', '.join(WORKLOADS)})")
    return names
