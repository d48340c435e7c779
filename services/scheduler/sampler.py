"""Batched sampling: one pass over the batch's logits with each row's own parameters.

Seeded draws use the exponential-race form of sampling (argmax of p / E, E ~ Exp(1)) with the
noise drawn from a generator keyed by the request's seed and the token's position, so a
request's tokens never depend on its neighbours, on chunking, or on retraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.messages import LogprobOut, SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9)) & _MASK


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled within the request's sequence
    output_counts: torch.Tensor | None  # [V] counts of generated tokens (penalties only)
    seen_mask: torch.Tensor | None  # [V] bool: in prompt or output (repetition penalty only)
    suppress: list[int]  # token ids banned for now (EOS before min_tokens)


def needs_counts(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place. Repetition as in CTRL/HF (over prompt and output); presence and frequency
    as OpenAI defines them (over output only)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.seen_mask is not None:
            x = logits[i]
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(row.seen_mask, penalized, x)
        if row.output_counts is not None and (p.presence_penalty or p.frequency_penalty):
            counts = row.output_counts
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def apply_bias_and_bans(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias.keys()), dtype=torch.long)
            vals = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype)
            logits[i, ids] += vals.to(logits.device)
        if row.suppress:
            logits[i, row.suppress] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on rows that sample; returns probabilities."""
    temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], device=logits.device)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        p = torch.tensor(top_p, device=logits.device)[:, None]
        # keep the smallest prefix whose mass reaches p (the top token is always kept)
        drop |= (probs.cumsum(-1) - probs) >= p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=logits.device)
    if bool((min_p > 0).any()):
        cutoff = probs.max(-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < cutoff, 0.0)
    return probs


def _draw(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=probs.device)
    for i, row in enumerate(rows):
        gen.manual_seed(position_seed(row.seed, row.position))
        noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(-1)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list | None]:
    """Returns the chosen tokens and, for rows that asked, their logprobs."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    processed = any(
        needs_counts(r.params) or r.params.logit_bias or r.suppress for r in rows
    )
    if processed:
        logits = logits.clone()
        apply_penalties(logits, rows)
        apply_bias_and_bans(logits, rows)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        tokens = logits.argmax(-1)
    else:
        tokens = logits.argmax(-1)
        idx = [i for i, g in enumerate(greedy) if not g]
        sel = torch.tensor(idx, device=logits.device)
        srows = [rows[i] for i in idx]
        tokens[sel] = _draw(_filter(logits[sel], srows), srows)
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return token_list, None
    out: list[LogprobOut | None] = []
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            out.append(None)
            continue
        lp = raw_logprobs[i]
        top: list[tuple[int, float]] = []
        if k > 0:
            vals, ids = lp.topk(k)
            top = list(zip(ids.tolist(), vals.tolist(), strict=True))
        out.append(LogprobOut(token_list[i], float(lp[token_list[i]]), top))
    return token_list, out
