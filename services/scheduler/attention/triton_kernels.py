"""Triton kernels over the paged KV cache: store, split-K decode, and extend (prefill).

Cache layout (see base.py): per layer `[num_slots, Hkv, D]`, num_slots = num_blocks * page_size.
KV position p of request b lives in slot `block_tables[b, p // page_size] * page_size
+ p % page_size`. Kernels gather per token, so any page size works and a block table
may point anywhere in the pool (shuffled, shared prefix blocks).

Softmax runs in base 2 (`exp2`, scale pre-multiplied by log2(e)) and accumulates in fp32
whatever the cache dtype. The split-K partial results keep their log-sum-exp in base 2 too.

Decode (one query token per request), split-K over the context:

    request b, KV head g:  [ split 0 | split 1 | ... | split S-1 ]   each split_len tokens
    _decode_kernel:        one program per (b, g, split) -> partial out + lse per query head
    _decode_reduce_kernel: one program per (b, query head) -> combines the S partials

All query heads of a KV head (the GQA group) share one program, so each K/V tile is read
once per group rather than once per query head.

Extend: one program per (request, query head, tile of BLOCK_M new tokens). The new tokens
sit at positions [prefix, seq_len) with prefix = seq_len - query_len; a token at position
p reads KV positions [0, p], the cached prefix from the pool and the new tokens causally
(they were stored by `store_kvcache` first).

A sliding window W (a layer's `window`, 0 for none) narrows that to [p - W + 1, p]: decode
splits and extend tiles start their loop at the window and mask per row inside it. A row can
then meet a tile it sees nothing of, so the running max is kept finite (no -inf - -inf).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _store_kvcache_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Slot_mapping,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slot_mapping + t).to(tl.int64)
    # A negative slot marks a padding token (e.g. a captured batch padded to a fixed size).
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = t.to(tl.int64)
    k = tl.load(K + src * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(V + src * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    tl.store(K_cache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :], k,
             mask=mask)
    tl.store(V_cache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :], v,
             mask=mask)


@triton.jit
def _decode_kernel(
    Q,
    K_cache,
    V_cache,
    Block_tables,
    Seq_lens,
    Out,
    Mid_o,
    Mid_lse,
    qk_scale,
    split_len,
    window,
    stride_q_t,
    stride_q_h,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    stride_o_t,
    stride_o_h,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:  # positions before seq_len - window are outside it: a split may be empty
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    # Padded group rows load zeros: their scores are finite, so no NaN, and they are not stored.
    q = tl.load(Q + b.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = Block_tables + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        # Entries past the request's length may be -1 or stale: only read the ones in range.
        block = tl.load(table + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = block * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_kc_s + kv_head * stride_kc_h + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + slot[:, None] * stride_vc_s + kv_head * stride_vc_h + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split past this request's end ran no iteration: it contributes weight 0 (lse -inf).
    has_tokens = l_i > 0.0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    store_mask = mask_g[:, None] & mask_d[None, :]
    if SINGLE_SPLIT:
        tl.store(Out + b.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        mid = Mid_o + b.to(tl.int64) * stride_mo_b + split * stride_mo_s
        tl.store(mid + heads[:, None] * stride_mo_h + offs_d[None, :], out, mask=store_mask)
        tl.store(Mid_lse + b.to(tl.int64) * stride_ml_b + heads * stride_ml_h + split, lse,
                 mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    Mid_o,
    Mid_lse,
    Out,
    num_splits,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Mid_lse + b.to(tl.int64) * stride_ml_b + h * stride_ml_h + offs_s, mask=mask_s,
                  other=float("-inf"))
    # The split holding the last token has a finite lse, so the max is finite and empty
    # splits weigh 0.
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = weight / tl.sum(weight, 0)
    mid = tl.load(Mid_o + b.to(tl.int64) * stride_mo_b + h * stride_mo_h
                  + offs_s[:, None] * stride_mo_s + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(mid * weight[:, None], 0)
    tl.store(Out + b.to(tl.int64) * stride_o_t + h * stride_o_h + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q,
    K_cache,
    V_cache,
    Block_tables,
    Query_start_loc,
    Seq_lens,
    Out,
    qk_scale,
    window,
    stride_q_t,
    stride_q_h,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_bt,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(Query_start_loc + b)
    q_len = tl.load(Query_start_loc + b + 1) - q_start
    # The grid is sized for the longest request; shorter ones leave tiles idle.
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(Seq_lens + b)
    prefix = seq_len - q_len
    kv_head = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = Block_tables + b.to(tl.int64) * stride_bt
    # The last new token in this tile sees positions up to its own; nothing later is needed.
    end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:  # the first new token in this tile sees nothing before its window
        lo = tl.maximum(0, prefix + m_block * BLOCK_M - window + 1)
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        block = tl.load(table + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = block * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_kc_s + kv_head * stride_kc_h + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        seen = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Without a window every row sees position 0 in the first tile, so m_new is finite;
        # with one, a row may see nothing of a tile yet: subtract 0 instead of -inf (no NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + slot[:, None] * stride_vc_s + kv_head * stride_vc_h + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # rows past the request's end may have seen nothing (with a window); they are not stored
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_o_t + h * stride_o_h + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; non-power-of-two head dims are padded and masked.
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # Default fp32 dots use TF32 on tensor cores (~1e-3 error); fp32 exists for exactness.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # Triton 3.9's interpreter computes bf16 dots wrongly (raw bits), so on CPU they run in
    # fp32 instead; compiled kernels keep bf16 operands for the tensor cores.
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("attention kernels need the head dim contiguous (stride 1)")


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot_mapping[t]] = k[t] (and v), skipping tokens whose slot is negative."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(k, v, k_cache, v_cache)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int,
    split_len: int,
    block_n: int = 32,
    window: int | None = None,
) -> None:
    """One query token per request (row b of q is request b), split-K over the context.

    `split_len` must be a multiple of `block_n` and num_splits * split_len >= max seq_len.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    _check_last_dim_contiguous(q, k_cache, v_cache, out)
    block_d = _block_d(head_dim)
    single = num_splits == 1
    if single:
        # Unused by the single-split variant; any tensor satisfies the signature.
        mid_o, mid_lse = out, out
        mo_strides, ml_strides = (0, 0, 0), (0, 0)
    else:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                            device=q.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32,
                              device=q.device)
        mo_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
        ml_strides = (mid_lse.stride(0), mid_lse.stride(1))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        scale * LOG2E, split_len, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        *mo_strides, *ml_strides,
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        HAS_WINDOW=bool(window),
        DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
    )
    if single:
        return
    _decode_reduce_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out, num_splits,
        *mo_strides, *ml_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits),
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
    scale: float,
    max_query_len: int,
    block_m: int = 32,
    block_n: int = 32,
    window: int | None = None,
) -> None:
    """New tokens of each request attend to its cached prefix and causally to each other.

    Any query length works, 1 included, so this also serves decode rows of a mixed batch.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    num_kv_heads = k_cache.shape[1]
    _check_last_dim_contiguous(q, k_cache, v_cache, out)
    _extend_kernel[(batch, num_q_heads, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=bool(window),
        DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
    )
