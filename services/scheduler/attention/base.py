"""The attention-backend interface: what one forward pass tells attention about the batch.

The batch is flat: the new tokens of every request packed back to back, no padding.

    request b's new tokens:   q[query_start_loc[b] : query_start_loc[b+1]]
    request b's KV positions: [0, seq_lens[b]), of which the last query_len(b) are new;
                              position p lives in slot block_tables[b, p // page_size] * page_size
                              + p % page_size of the per-layer cache tensors
    new token t's slot:       slot_mapping[t]

A new token at position p attends causally to KV positions [0, p], or with a sliding window
of W to [p - W + 1, p] (transformers' convention: the last W positions, its own included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def cache_slots(block_table: Sequence[int], begin: int, end: int, page_size: int) -> list[int]:
    """The cache slots of a request's positions [begin, end), its blocks in `block_table`
    (the model runner computes a step's with numpy, over every row at once)."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(begin, end)]


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B], KV length of each request after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], -1 or any id past the end
    slot_mapping: torch.Tensor  # int64 [T], cache slot of each new token
    query_lens_cpu: list[int]  # host copies, so backends can plan without a device sync
    seq_lens_cpu: list[int]
    page_size: int

    @classmethod
    def for_spans(cls, spans: list[tuple[int, int]], block_tables: torch.Tensor,
                  page_size: int) -> AttentionMetadata:
        """A step where request b has spans[b] = (cached tokens, new tokens), its blocks in
        block_tables[b]: the new tokens' slots follow from the table (how tests and benches
        lay out a step)."""
        rows = block_tables.tolist()
        slots = [slot for b, (c, n) in enumerate(spans)
                 for slot in cache_slots(rows[b], c, c + n, page_size)]
        qlens = [n for _, n in spans]
        lens = [c + n for c, n in spans]
        return cls(query_start_loc=torch.tensor([0, *qlens]).cumsum(0).int(),
                   seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=block_tables,
                   slot_mapping=torch.tensor(slots), query_lens_cpu=qlens, seq_lens_cpu=lens,
                   page_size=page_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token (a pure decode step)."""
        return all(n == 1 for n in self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


class AttentionBackend:
    """Writes the step's new K/V into the paged cache, then attends over the cache.

    Shapes: q [T, Hq, D]; k, v [T, Hkv, D]; k_cache, v_cache [num_slots, Hkv, D] where
    num_slots = num_blocks * page_size. Returns [T, Hq, D]. Hq is a multiple of Hkv (GQA).
    `window`: the layer's sliding window (None: full causal attention).
    """

    name = "base"

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
        raise NotImplementedError
