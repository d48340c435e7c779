"""The paged KV pool's books: which blocks are free, used, or cached for reuse.

A block is in exactly one of three states:

    used    ref_cnt > 0            some request's block table points at it
    cached  ref_cnt == 0, hashed   holds a full block of a known token prefix; reusable
    free    ref_cnt == 0, no hash  holds nothing of value

Cached and free blocks both sit in `evictable`, least recently released first, so allocation
takes plain free blocks and the coldest cached ones alike (vLLM's free-block queue). A full
block is named by a hash chained over every token before it (`common/block_hash.py`), so a hit
is always a whole prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.messages import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class BlockPool:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_cache: bool = True) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_cnt = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.tag_of: dict[bytes, str] = {}  # a cached hash -> the LoRA adapter it was made under
        self.evictable: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # What entered and left the cache since the last `take_events`, for routers elsewhere;
        # None: nobody listens, keep nothing.
        self.events: list[KvEvent] | None = None
        self.num_evictions_total = 0  # cached blocks handed out again, their prefix forgotten
        self.num_allocated_total = 0  # blocks handed out: a prefix computed twice shows here

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        """Blocks an allocation can take: free ones and unreferenced cached ones."""
        return len(self.evictable)

    @property
    def num_cached(self) -> int:
        return sum(1 for b in self.evictable if b in self.hash_of)

    @property
    def num_free(self) -> int:
        return self.num_evictable - self.num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_evictable

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.evictable):
            raise MemoryError(f"need {n} blocks, {len(self.evictable)} available")
        out = []
        for _ in range(n):
            block, _ = self.evictable.popitem(last=False)
            h = self.hash_of.pop(block, None)
            if h is not None:
                del self.block_of[h]
                self.tag_of.pop(h, None)
                self._removed(h)
                self.num_evictions_total += 1
            self.ref_cnt[block] = 1
            out.append(block)
        self.num_allocated_total += n
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each; tail blocks go first in line for eviction."""
        for block in reversed(blocks):
            assert self.ref_cnt[block] > 0, f"double free of block {block}"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.evictable[block] = None

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The longest run of cached blocks for these full-block hashes (no references taken)."""
        hits = []
        if self.enable_prefix_cache:
            for h in hashes:
                block = self.block_of.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks found by `match_prefix`."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.evictable[block]
            self.ref_cnt[block] += 1

    def register(self, block: int, h: bytes, parent: bytes | None,
                 tag: str | None = None) -> None:
        """A full, computed block becomes findable by its prefix hash (`parent`: the previous
        block's, None for a first block); `tag`: the LoRA adapter whose KV it holds."""
        if not self.enable_prefix_cache or block in self.hash_of or h in self.block_of:
            return
        self.hash_of[block] = h
        self.block_of[h] = block
        if tag is not None:
            self.tag_of[h] = tag
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)  # the chain goes on
            else:
                self.events.append(BlockStored([h], parent))

    def _removed(self, h: bytes) -> None:
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(h)
            else:
                self.events.append(BlockRemoved([h]))

    def forget(self, tag: str) -> int:
        """Forget the cached blocks made under adapter `tag` (unloaded: a later adapter of the
        same name, other weights, hashes alike). Its requests have all left, so none is in use;
        the blocks stay evictable, now free. How many."""
        gone = [h for h, t in self.tag_of.items() if t == tag]
        for h in gone:
            block = self.block_of.pop(h)
            assert self.ref_cnt[block] == 0, f"block {block} of adapter {tag!r} still in use"
            del self.hash_of[block], self.tag_of[h]
            self._removed(h)
        return len(gone)

    def flush(self) -> int:
        """Forget every cached prefix (refused by the caller while requests run)."""
        n = len(self.hash_of)
        self.hash_of.clear()
        self.block_of.clear()
        self.tag_of.clear()
        if self.events is not None:
            self.events = [AllBlocksCleared()]  # what came before no longer matters
        return n

    # -- events -------------------------------------------------------------------------------
    def record_events(self) -> None:
        """Start keeping events, before anything is cached: the first says "empty", so a
        consumer that knew this scheduler's earlier life (same id, restarted) starts over."""
        assert not self.hash_of, "events must start with an empty cache"
        self.events = [AllBlocksCleared()]

    def take_events(self) -> list[KvEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def check_integrity(self) -> None:
        """free + cached + used == total, and the books agree with each other."""
        in_use = sum(1 for c in self.ref_cnt if c > 0)
        assert all(c >= 0 for c in self.ref_cnt), "negative reference count"
        assert in_use + len(self.evictable) == self.num_blocks, (
            f"used {in_use} + evictable {len(self.evictable)} != {self.num_blocks}"
        )
        assert all(self.ref_cnt[b] == 0 for b in self.evictable), "referenced block evictable"
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks
        assert len(self.hash_of) == len(self.block_of)
        assert all(self.block_of[h] == b for b, h in self.hash_of.items())
        assert self.tag_of.keys() <= self.block_of.keys(), "a tag outlived its cached block"
