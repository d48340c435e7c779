"""Decode attention over a prefix that many requests share, attended once (cascade attention).

A burst of requests behind one long document (issue 45's shared-doc: 32 questions after the
same 3,000 tokens) holds the document's cached blocks in every request's block table. The C++
decode kernel attends each request on its own, so every step scores the document once per
request: on the AMX Xeon VM 69 ms of a 30-layer bfloat16 step at 32 requests, most of it.

Here the decode rows whose tables start with the same blocks are a group, and a layer runs

    shared:  the group's queries stacked, [1, Hkv, k * G, D]  x  the shared blocks' K, V once
    tails:   each row's own blocks after them, [k, Hkv, G, D]  x  its tail (masked past its end)

both through torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`: float32
scores and softmax, bfloat16 products on AMX where the CPU has it, and each row's log-sum-exp
out), then merges the two parts of every row by their log-sum-exps, as the C++ kernel merges
the pieces of a long row. The rest of the step's decode rows go to the C++ kernel as before.
Sliding-window layers keep the kernel for every row (a shared prefix is not the window's).
`TOKENLINE_CASCADE=0` turns this off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.scheduler.attention.base import AttentionMetadata

# A group is attended this way from this many rows sharing this many positions, and rows x
# shared positions at least MIN_PAIRS in its dtype: below, the extra calls per layer (two flash
# calls, the gathers, the merge: ~0.17 ms) cost more than they save. One layer of SmolLM2's
# heads, the kernel's time over this path's (AMX Xeon VM, 2 threads, blocks in cache):
# bfloat16 16 x 2,048 0.99x, 16 x 3,072 1.11x, 32 x 1,536 1.31x, 32 x 3,072 1.80x, 64 x 2,048
# 2.07x, 8 x 3,072 0.71x; float32 24 x 3,072 0.97x, 64 x 1,024 1.02x, 32 x 3,072 1.31x, 64 x
# 2,048 1.36x (the flash kernel's float32 products are not AMX's).
CASCADE_MIN_ROWS = 4
CASCADE_MIN_TOKENS = 256
MIN_PAIRS = {torch.bfloat16: 48 * 1024, torch.float32: 96 * 1024}


def enabled() -> bool:
    setting = os.environ.get("TOKENLINE_CASCADE", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"TOKENLINE_CASCADE must be 0 or 1, not {setting!r}")
    return setting == "1"


@dataclass
class Cascade:
    """Decode rows that share their first `shared_ids` blocks."""

    requests: torch.Tensor  # int64 [k]: the rows' requests (batch indices)
    tokens: torch.Tensor  # int64 [k]: their rows in q and out
    shared_ids: torch.Tensor  # int64 [S]: the shared blocks, in order
    tail_ids: torch.Tensor  # int64 [k * T]: each row's blocks after them (padded, masked)
    tail_len: int  # T * page_size
    mask: torch.Tensor  # [k, 1, 1, tail_len] additive, 0 or -inf past each row's end
    # the first shared block when the shared blocks are consecutive in the pool (a document
    # prefilled in one go usually is): then its K and V are read in place, not gathered
    shared_start: int | None = None


def _groups(tables: torch.Tensor, cand: list[int], cached: list[int], p: int):
    """(positions in `cand`, shared blocks) for each group of CASCADE_MIN_ROWS or more of the
    requests `cand` whose tables start with the same blocks, `cached[i]` the positions of
    cand[i] that may be shared. Once per step: only first blocks held by enough requests are
    looked at (a batch of 64 unrelated requests costs one `unique`)."""
    cand_t = torch.tensor(cand, dtype=torch.long, device=tables.device)
    first = tables[cand_t, 0]
    blocks, counts = first.unique(return_counts=True)
    for block in blocks[(counts >= CASCADE_MIN_ROWS) & (blocks >= 0)].tolist():
        at = (first == block).nonzero().flatten()
        reqs = cand_t[at]
        limit = min(cached[i] for i in at.tolist()) // p  # blocks every member may share
        if limit * p < CASCADE_MIN_TOKENS:
            continue
        same = (tables[reqs, :limit] == tables[reqs[0], :limit]).all(0).int().cumprod(0)
        yield at.tolist(), int(same.sum().item())


def _min_pairs(dtype: torch.dtype) -> int:
    return MIN_PAIRS.get(dtype, MIN_PAIRS[torch.float32])  # another dtype: as float32


def _consecutive_start(ids: torch.Tensor) -> int | None:
    """The first of `ids` when they follow one another in the pool (read in place), else None."""
    return int(ids[0]) if ids.numel() < 2 or bool((ids.diff() == 1).all()) else None


def plan_cascades(meta: AttentionMetadata, rows: list[int], tokens: list[int],
                  dtype: torch.dtype) -> list[Cascade]:
    """The groups of decode rows (`rows`: batch indices, `tokens`: their rows in q) that share
    at least CASCADE_MIN_TOKENS cached positions, CASCADE_MIN_ROWS rows or more each, and rows x
    positions of MIN_PAIRS or more."""
    if len(rows) < CASCADE_MIN_ROWS or not enabled():
        return []
    p, lens = meta.page_size, meta.seq_lens_cpu
    # whole blocks before every row's newest position (the one this step writes)
    cached = [lens[b] - 1 for b in rows]
    out = []
    for at, shared in _groups(meta.block_tables, rows, cached, p):
        if shared * p < CASCADE_MIN_TOKENS or len(at) * shared * p < _min_pairs(dtype):
            continue
        reqs = [rows[i] for i in at]
        out.append(_cascade(meta, reqs, [tokens[i] for i in at], [lens[b] for b in reqs],
                            shared, dtype))
    return out


def _cascade(meta: AttentionMetadata, members: list[int], tokens: list[int], seq: list[int],
             shared: int, dtype: torch.dtype) -> Cascade:
    p, tables = meta.page_size, meta.block_tables
    reqs = torch.tensor(members, dtype=torch.long, device=tables.device)
    blocks = max(-(-n // p) for n in seq) - shared
    tail = tables[reqs, shared : shared + blocks].clamp(min=0)  # -1 past a row's end: masked
    span = torch.arange(blocks * p, device=tables.device)
    left = torch.tensor(seq, device=tables.device) - shared * p
    mask = torch.zeros(len(seq), blocks * p, dtype=dtype, device=tables.device)
    mask.masked_fill_(span[None, :] >= left[:, None], float("-inf"))
    ids = tables[reqs[0], :shared].long()
    return Cascade(reqs, torch.tensor(tokens, dtype=torch.long, device=tables.device), ids,
                   tail.reshape(-1).long(), blocks * p, mask[:, None, None, :],
                   _consecutive_start(ids))


def _flash():
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _stacked(qm: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
             mask: torch.Tensor | None = None):
    """Every row of qm ([m, Hkv, G, D]) over one K, V ([L, Hkv, D]) in one call, the rows'
    queries stacked per KV head (`mask`: additive, [1, 1, m * G, L]): (out [m, Hkv, G, D],
    log-sum-exp [m, Hkv, G])."""
    m, hkv, g, d = qm.shape
    o, lse = _flash()(qm.permute(1, 0, 2, 3).reshape(1, hkv, m * g, d),
                      keys.transpose(0, 1)[None], values.transpose(0, 1)[None], 0.0, False,
                      attn_mask=mask, scale=scale)
    return o.view(hkv, m, g, d).permute(1, 0, 2, 3), lse.view(hkv, m, g).permute(1, 0, 2)


def _merge(o_s: torch.Tensor, lse_s: torch.Tensor, o_t: torch.Tensor,
           lse_t: torch.Tensor) -> torch.Tensor:
    """Two parts of the same rows' attention ([m, Hkv, G, D] and their log-sum-exps) as one,
    in float32, [m, Hkv * G, D]."""
    lse = torch.logaddexp(lse_s, lse_t)
    merged = (o_s.float() * torch.exp(lse_s - lse).unsqueeze(-1)
              + o_t.float() * torch.exp(lse_t - lse).unsqueeze(-1))
    return merged.flatten(1, 2)


def attend(c: Cascade, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           tail_keys: torch.Tensor, tail_values: torch.Tensor, scale: float,
           out: torch.Tensor) -> None:
    """The group's rows of `out` ([T, Hq, D]) from q's ([T, Hq, D]); `keys`/`values`: the
    shared blocks gathered, [S * page, Hkv, D]; `tail_keys`/`tail_values`: the rows' tails
    gathered, [k * tail_len, Hkv, D]."""
    k = c.tokens.numel()
    hkv, d = keys.shape[1], keys.shape[2]
    qm = q.index_select(0, c.tokens).view(k, hkv, q.shape[1] // hkv, d)
    o_s, lse_s = _stacked(qm, keys, values, scale)
    shape = (k, c.tail_len, hkv, d)
    o_t, lse_t = _flash()(qm, tail_keys.view(shape).transpose(1, 2),
                          tail_values.view(shape).transpose(1, 2), 0.0, False,
                          attn_mask=c.mask, scale=scale)
    out.index_copy_(0, c.tokens, _merge(o_s, lse_s, o_t, lse_t).to(out.dtype))


# -- prompts after a shared prefix (a burst's questions behind one document) -------------------


@dataclass
class ExtendCascade:
    """Requests with several new tokens whose cached prefixes start with the same blocks: their
    new tokens' queries attend the shared blocks once, stacked, and their own positions after
    them (their cached tail and the new tokens, causally) one request at a time."""

    members: list[int]  # the requests (batch indices)
    rows: torch.Tensor  # int64 [sum n]: every member's new-token rows in q, member by member
    spans: list[tuple[int, int]]  # each member's (first row in q, new tokens)
    tail_ids: list[torch.Tensor]  # each member's blocks after the shared ones
    masks: list[torch.Tensor]  # each member's [1, 1, n * G, len(tail) * page] additive mask
    shared_ids: torch.Tensor
    shared_start: int | None


def plan_extend_cascades(meta: AttentionMetadata, requests: list[int], starts: list[int],
                         group: int, dtype: torch.dtype) -> list[ExtendCascade]:
    """Groups among `requests` (batch indices with several new tokens; starts: every request's
    first row in q) that share CASCADE_MIN_TOKENS cached positions or more, CASCADE_MIN_ROWS
    members or more, and new tokens x shared positions of MIN_PAIRS or more; `group` is the
    query heads per KV head."""
    p, lens, news = meta.page_size, meta.seq_lens_cpu, meta.query_lens_cpu
    cand = [b for b in requests if lens[b] - news[b] >= CASCADE_MIN_TOKENS]
    if len(cand) < CASCADE_MIN_ROWS or not enabled():
        return []
    out = []
    for at, shared in _groups(meta.block_tables, cand, [lens[b] - news[b] for b in cand], p):
        members = [cand[i] for i in at]
        total_new = sum(news[b] for b in members)
        if shared * p < CASCADE_MIN_TOKENS or total_new * shared * p < _min_pairs(dtype):
            continue
        out.append(_extend_cascade(meta, members, starts, shared, group, dtype))
    return out


def _extend_cascade(meta: AttentionMetadata, members: list[int], starts: list[int],
                    shared: int, group: int, dtype: torch.dtype) -> ExtendCascade:
    p, lens, news, tables = meta.page_size, meta.seq_lens_cpu, meta.query_lens_cpu, \
        meta.block_tables
    dev = tables.device
    rows, spans, tail_ids, masks = [], [], [], []
    for b in members:
        n, seq = news[b], lens[b]
        rows.append(torch.arange(starts[b], starts[b] + n, device=dev))
        spans.append((starts[b], n))
        blocks = -(-seq // p) - shared
        tail_ids.append(tables[b, shared : shared + blocks].long())
        key = torch.arange(blocks * p, device=dev) + shared * p  # absolute positions
        query = torch.arange(seq - n, seq, device=dev)
        hidden = key[None, :] > query[:, None]  # after the query (and past the end)
        mask = torch.zeros(n, blocks * p, dtype=dtype, device=dev).masked_fill_(hidden,
                                                                                float("-inf"))
        masks.append(mask.repeat_interleave(group, 0)[None, None])
    ids = tables[members[0], :shared].long()
    return ExtendCascade(members, torch.cat(rows), spans, tail_ids, masks, ids,
                         _consecutive_start(ids))


def attend_extend(c: ExtendCascade, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  gather, scale: float, out: torch.Tensor) -> None:
    """The members' rows of `out` ([T, Hq, D]) from q's; `keys`/`values`: the shared blocks,
    [S * page, Hkv, D]; `gather(ids)`: a member's tail blocks as (keys, values) [L, Hkv, D]."""
    hkv, d = keys.shape[1], keys.shape[2]
    qm = q.index_select(0, c.rows).view(c.rows.numel(), hkv, q.shape[1] // hkv, d)
    o_s, lse_s = _stacked(qm, keys, values, scale)
    at = 0
    for (start, n), ids, mask in zip(c.spans, c.tail_ids, c.masks, strict=True):
        tk, tv = gather(ids)
        o_t, lse_t = _stacked(qm[at : at + n], tk, tv, scale, mask)  # causal per query
        out[start : start + n] = _merge(o_s[at : at + n], lse_s[at : at + n], o_t,
                                        lse_t).to(out.dtype)
        at += n

