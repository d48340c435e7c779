"""Attention over the paged cache in plain torch (CPU, and the oracle for kernels).

Where the time goes on CPU is reading the cache, so this backend reads as little as it can:

- a prefill chunk with no cached prefix attends to its own fresh k, v (no cache read at all);
- everything else gathers whole blocks (one contiguous row of page_size * Hkv * D values per
  block, with index_select's memcpy path) rather than single slots;
- decodes are sorted by length and run in groups of similar length, each group padded only to
  its own longest, so a batch of 64 with contexts from 50 to 800 reads about what it needs
  instead of 64 x 800 slots.

    decode rows sorted by seq_len:  [ 37 48 52 60 | 301 312 330 ... ] groups of DECODE_GROUP
    one group:  q [n, Hq, 1, D]  x  blocks gathered into [n, Lg, Hkv, D]  (Lg = group's longest,
                rounded up to a page; a mask hides the tail of the shorter rows)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.attention.base import AttentionBackend, AttentionMetadata

# Rows per decode group: fewer groups mean fewer calls, more mean less padding. On a 2-core CPU
# with SmolLM2 and contexts of 50-800 tokens, groups of 8 were within a few percent of the best.
DECODE_GROUP = 8


@dataclass
class _Group:
    """Decode rows of similar length, run as one padded attention call."""

    rows: torch.Tensor  # positions within the decode rows
    block_ids: torch.Tensor  # [n * num_blocks] cache blocks to gather, row by row
    length: int  # num_blocks * page_size
    mask: torch.Tensor | None  # [n, 1, 1, length], None when every row fills `length`


@dataclass
class _Plan:
    """What every layer of one step reuses: built once per AttentionMetadata."""

    starts: list[int]  # query_start_loc on the host
    decode_rows: list[int]  # requests with one new token
    decode_tokens: list[int]  # their token index in q
    groups: list[_Group]


def _plan(meta: AttentionMetadata, device: torch.device) -> _Plan:
    p = meta.page_size
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    rows = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    lens = meta.seq_lens_cpu
    order = sorted(range(len(rows)), key=lambda i: lens[rows[i]])
    groups = []
    for g in range(0, len(order), DECODE_GROUP):
        members = order[g : g + DECODE_GROUP]
        reqs = [rows[i] for i in members]
        num_blocks = -(-max(lens[b] for b in reqs) // p)
        tables = meta.block_tables[torch.tensor(reqs, device=device), :num_blocks]
        mask = None
        if min(lens[b] for b in reqs) < num_blocks * p:
            span = torch.arange(num_blocks * p, device=device)
            seq = torch.tensor([lens[b] for b in reqs], device=device)
            mask = (span[None, :] < seq[:, None])[:, None, None, :]
        groups.append(_Group(
            rows=torch.tensor(members, device=device),
            block_ids=tables.clamp(min=0).reshape(-1).long(),  # -1 past the end: masked anyway
            length=num_blocks * p,
            mask=mask,
        ))
    return _Plan(starts, rows, [starts[b] for b in rows], groups)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """The listed blocks of a [num_slots, Hkv, D] cache, back to back: [len * page_size, Hkv, D]."""
    if cache.shape[0] % page_size == 0:
        blocks = cache.view(-1, page_size * cache.shape[1] * cache.shape[2])
        return blocks.index_select(0, block_ids).view(-1, *cache.shape[1:])
    offsets = torch.arange(page_size, device=cache.device)
    slots = (block_ids[:, None] * page_size + offsets[None, :]).reshape(-1)
    return cache.index_select(0, slots)


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta is not self._meta:  # the first layer of a step plans for all of them
            self._meta, self._plan = meta, _plan(meta, q.device)
        plan = self._plan
        assert plan is not None
        qlens = meta.query_lens_cpu
        if len(plan.decode_rows) == len(qlens):
            return self._decode(q, k_cache, v_cache, plan, meta.page_size, scale)
        out = torch.empty_like(q)
        if plan.decode_rows:
            tokens = plan.decode_tokens
            out[tokens] = self._decode(q[tokens], k_cache, v_cache, plan, meta.page_size, scale)
        for b, n in enumerate(qlens):
            if n == 1:
                continue
            s, e = plan.starts[b], plan.starts[b + 1]
            # 4-D [1, H, n, D]: with 3-D inputs SDPA takes its slow math path on CPU
            qh = q[s:e].transpose(0, 1)[None]
            if n == meta.seq_lens_cpu[b]:  # the whole sequence is new: attend to it as it is
                o = F.scaled_dot_product_attention(
                    qh, k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    is_causal=True, scale=scale, enable_gqa=True,
                )
            else:
                o = self._extend(qh, k_cache, v_cache, meta, b, scale)
            out[s:e] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, plan: _Plan, page_size: int, scale: float):
        """One new token per decode row; q[i] and the result's row i are decode_rows[i]'s."""
        out = torch.empty_like(q)
        for g in plan.groups:
            shape = (-1, g.length, *k_cache.shape[1:])
            keys = _gather(k_cache, g.block_ids, page_size).view(shape).transpose(1, 2)
            values = _gather(v_cache, g.block_ids, page_size).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.rows].unsqueeze(2),  # [n, Hq, 1, D]
                keys,  # [n, Hkv, length, D], a strided view of the gathered blocks
                values,
                attn_mask=g.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[g.rows] = o.squeeze(2)
        return out

    @staticmethod
    def _extend(qh, k_cache, v_cache, meta: AttentionMetadata, b: int, scale: float):
        """New tokens of one request after a cached prefix: attend causally to all of it."""
        n, total = qh.shape[2], meta.seq_lens_cpu[b]
        p = meta.page_size
        ids = meta.block_tables[b, : -(-total // p)].long()
        keys = _gather(k_cache, ids, p)[:total].transpose(0, 1)[None]  # [1, Hkv, total, D]
        values = _gather(v_cache, ids, p)[:total].transpose(0, 1)[None]
        qpos = torch.arange(total - n, total, device=qh.device)
        mask = torch.arange(total, device=qh.device)[None, :] <= qpos[:, None]
        return F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
