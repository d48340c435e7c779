"""The name of a full KV block: a hash chained over every token before it (vLLM's prefix hash).

The scheduler's prefix cache names its blocks with it, and the tokenizer's router computes the
same names for a request to learn which scheduler already holds its prefix: one function, so
the two can never disagree. A hit on block i is a hit on the whole prefix up to it.

A salt (a per-request `cache_salt`) is folded into the first block only; every later block
chains from it, so requests with different salts share nothing. A LoRA adapter's name is
folded in the same way (tagged apart from salts), so one prompt under two adapters, or under an
adapter and the base, never shares KV: the KV of every layer depends on the adapter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = b"tokenline-root"


def block_hash(parent: bytes, tokens: Sequence[int], salt: str | None = None,
               adapter: str | None = None) -> bytes:
    if salt is not None:
        # length-prefixed, so no salt reads as another salt followed by tokens
        encoded = salt.encode()
        parent = hashlib.sha256(parent + len(encoded).to_bytes(8, "little") + encoded).digest()
    if adapter is not None:  # tagged in front, so no salt hashes as an adapter's name
        encoded = adapter.encode()
        parent = hashlib.sha256(b"\x01lora" + parent + len(encoded).to_bytes(8, "little")
                                + encoded).digest()
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], page_size: int,
                        num_blocks: int, salt: str | None = None,
                        adapter: str | None = None) -> list[bytes]:
    """Append the hashes of blocks len(hashes)..num_blocks-1 of `tokens` to `hashes`."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        chunk = tokens[i * page_size : (i + 1) * page_size]
        hashes.append(block_hash(hashes[-1], chunk) if hashes
                      else block_hash(ROOT_HASH, chunk, salt, adapter))
    return hashes


def prefix_block_hashes(tokens: Sequence[int], page_size: int,
                        salt: str | None = None, adapter: str | None = None) -> list[bytes]:
    """The hashes a prefix-cache hit may cover: full blocks, never the last token's
    (the engine must compute at least one token to sample from)."""
    return extend_block_hashes([], tokens, page_size, (len(tokens) - 1) // page_size, salt,
                               adapter)
