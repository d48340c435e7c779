"""Reference attention over the paged cache in plain torch (CPU, and the oracle for kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.scheduler.attention.base import AttentionBackend, AttentionMetadata


def _slots(block_table: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for one block table (or a batch of them)."""
    pos = torch.arange(length, device=block_table.device)
    blocks = block_table[..., pos // page_size].long()
    return blocks * page_size + pos % page_size


class TorchBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        qlens = meta.query_lens_cpu
        decode_rows = [b for b, n in enumerate(qlens) if n == 1]
        extend_rows = [b for b, n in enumerate(qlens) if n != 1]
        if len(decode_rows) == len(qlens):
            out[:] = self._decode(q, k_cache, v_cache, meta, scale, None)
            return out
        starts = meta.query_start_loc.tolist()
        if decode_rows:
            sel = torch.tensor(decode_rows, dtype=torch.long, device=q.device)
            tok = torch.tensor([starts[b] for b in decode_rows], device=q.device)
            out[tok] = self._decode(q[tok], k_cache, v_cache, meta, scale, sel)
        for b in extend_rows:
            s, e = starts[b], starts[b + 1]
            out[s:e] = self._extend(q[s:e], k_cache, v_cache, meta, b, scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, rows):
        """One new token per request: gather each request's KV, padded to the longest."""
        tables = meta.block_tables if rows is None else meta.block_tables[rows]
        seq_lens = meta.seq_lens if rows is None else meta.seq_lens[rows]
        lens_cpu = meta.seq_lens_cpu if rows is None else [meta.seq_lens_cpu[i] for i in rows]
        max_len = max(lens_cpu)
        slots = _slots(tables, max_len, meta.page_size)  # [B, L]
        keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache[slots].transpose(1, 2)
        mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    @staticmethod
    def _extend(q, k_cache, v_cache, meta, b, scale):
        """New tokens of one request: attend to its cached prefix and causally to each other."""
        n, total = q.shape[0], meta.seq_lens_cpu[b]
        slots = _slots(meta.block_tables[b], total, meta.page_size)
        keys = k_cache[slots].transpose(0, 1)  # [Hkv, L, D]
        values = v_cache[slots].transpose(0, 1)
        qh = q.transpose(0, 1)  # [Hq, n, D]
        if n == total:
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            qpos = torch.arange(total - n, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        return o.transpose(0, 1)
