"""Paged attention with Triton kernels (GPU; CPU under TRITON_INTERPRET=1 for tests).

A pure decode step runs the split-K decode kernel. Any step with a prefill or extend
chunk runs the extend kernel for every request, decode rows included (a query of length
one is just a short extend), so mixed batches need no gather/scatter of rows.
"""

from __future__ import annotations

import functools

import torch
import triton

from services.scheduler.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.attention.triton_kernels import (
    decode_attention,
    extend_attention,
    store_kvcache,
)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        min_split_tokens: int = 128,
        max_splits: int = 32,
        decode_block_n: int = 64,
        extend_block_m: int = 64,
        extend_block_n: int = 64,
    ) -> None:
        self.min_split_tokens = min_split_tokens
        self.max_splits = max_splits
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_seqs == 0:
            return out
        if meta.is_decode:
            num_splits, split_len = self.plan_splits(
                meta.num_seqs, k_cache.shape[1], meta.max_seq_len, q.device
            )
            decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out,
                meta.page_size, scale, num_splits, split_len, block_n=self.decode_block_n,
                window=window,
            )
        else:
            extend_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                out, meta.page_size, scale, meta.max_query_len,
                block_m=self.extend_block_m, block_n=self.extend_block_n, window=window,
            )
        return out

    def plan_splits(
        self, batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device
    ) -> tuple[int, int]:
        """(number of splits, tokens per split) for a decode step.

        Long contexts split so that a small batch still spreads over the GPU; each split
        keeps at least `min_split_tokens` so the reduce stays cheap next to the reads.
        """
        splits = min(self.max_splits, triton.cdiv(max_seq_len, self.min_split_tokens))
        if device.type == "cuda":
            # Once batch x KV heads covers every SM twice, more splits only add reduce work.
            index = device.index if device.index is not None else torch.cuda.current_device()
            splits = min(splits, triton.cdiv(2 * _sm_count(index), batch * num_kv_heads))
        splits = max(1, splits)
        block = self.decode_block_n
        split_len = triton.cdiv(triton.cdiv(max_seq_len, splits), block) * block
        return triton.cdiv(max_seq_len, split_len), split_len
