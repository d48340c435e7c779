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

With `use_native` (the model runner sets it on CPU in float32 or bfloat16 when the kernel
builds), decodes instead go to a small C++ kernel (paged_decode_cpu.cpp) that reads each cached
block once, straight from the block table: about 3x less memory traffic than gather + SDPA. A
decode-only step is one call per layer: the new K/V rows go into the cache inside it, q is read
as the projection's strided rows, and the int32 tables and lengths are made once per step (in
the plan), so batch 1 pays one C++ call per layer instead of five. In a mixed step the cache
writes are one call (`write_kv`) and the decode rows are read from q's rows and written into
out's by the kernel (no gather or scatter). Without it, and as the reference, everything here is
plain torch.

With `use_native_prefill` (set the same way), the requests with several new tokens (a fresh
prompt, a chunk of a long one, the tokens after a cached prefix) go to paged_prefill_cpu.cpp in
one call per layer: flash-style tiles over the paged cache, the prefix read through the block
table rather than gathered, the tiles the causal mask hides skipped; 3-5x torch's SDPA at
128-2,048 tokens (docs/benchmarks-history.md, "Prefill and extend attention in C++"). Without
it they run SDPA: a fresh prompt on its own k, v (is_causal), an extend over its gathered blocks
with a bool mask. In bfloat16 that is torch's flash kernel, which multiplies in bf16 and sums,
and takes the softmax, in float32; the C++ kernel does the same with AVX512-BF16 dot products.

A sliding-window layer masks out keys more than `window - 1` positions before each query (the
C++ kernel starts its walk at the window instead); the cache itself is the same for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.logging import get_logger
from services.scheduler.attention import cascade
from services.scheduler.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.native import DECODE, PREFILL, NativeKernels

log = get_logger("attention")

# Rows per decode group: fewer groups mean fewer calls, more mean less padding. On a 2-core CPU
# with SmolLM2 and contexts of 50-800 tokens, groups of 8 were within a few percent of the best.
DECODE_GROUP = 8

# Fresh bfloat16 prompts run SDPA at a multiple of this many tokens (see _fresh_prompt).
SDPA_PAD = 16


@dataclass(frozen=True)
class SdpaRoute:
    """Which requests with several new tokens go to torch's SDPA instead of our prefill kernel
    (TorchBackend.sdpa; the model runner sets AMX_BF16 where it pays, docs/benchmarks-history.md
    has the grids): fresh prompts of `prompts_from` tokens or more, and extends (new tokens after a
    cached prefix: a chunked prompt's next chunk, a prefix-cache hit) of `extend_min_new` new
    tokens or more that attend to `extend_pairs` (query, key) pairs or more under the causal
    mask (None: extends stay in the kernel)."""

    prompts_from: int
    extend_pairs: int | None = None
    extend_min_new: int = 1

    def takes(self, new: int, total: int) -> bool:
        """Whether a request of `new` tokens out of `total` runs SDPA."""
        if new < 2:
            return False
        if new == total:
            return new >= self.prompts_from
        pairs = new * (total - new) + new * (new + 1) // 2
        return (self.extend_pairs is not None and new >= self.extend_min_new
                and pairs >= self.extend_pairs)


# bfloat16 where the CPU has AMX: torch's flash kernel multiplies on AMX tiles, ours does not.
# - Fresh prompts from 256 tokens: 264 against our kernel's 95 GFLOP/s at 2,048 tokens, 0.85
#   against 1.10 ms a layer at 256; at 128, and in a burst of short prompts, ours is as fast.
# - Extends from 64K attended pairs: as fast as ours at 64K (256 new after 128 cached), faster
#   above (100 after 1,024: 0.66x our time; 256 after 2,048: 0.55x), slower below (128 after
#   128: 1.24x).
# - and 48 new tokens or more: below that the gather of the whole prefix costs more than SDPA
#   saves (32 new after 2,048: 1.67 ms in SDPA against 1.60 in ours).
# `python -m bench.prefill_attention --extends ...` measures the grid on a machine.
AMX_BF16 = SdpaRoute(prompts_from=256, extend_pairs=1 << 16, extend_min_new=48)


@dataclass
class _Group:
    """Decode rows of similar length, run as one padded attention call."""

    start: int  # the group is rows [start, end) of the decode rows sorted by length
    end: int
    block_ids: torch.Tensor  # [n * num_blocks] cache blocks to gather, row by row
    length: int  # num_blocks * page_size
    mask: torch.Tensor | None  # [n, 1, 1, length] additive (0 or -inf); None when all full
    seq: torch.Tensor  # [n] the rows' lengths
    longest: int
    windowed: dict[int, torch.Tensor]  # window -> its mask, made by the first layer needing it

    def mask_for(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask for a layer with this sliding window (None: the plain one)."""
        if window is None or self.longest <= window:
            return self.mask
        if window not in self.windowed:
            span = torch.arange(self.length, device=self.seq.device)
            hidden = (span[None, :] >= self.seq[:, None]) | (
                span[None, :] < self.seq[:, None] - window)
            mask = torch.zeros(hidden.shape, dtype=dtype, device=self.seq.device)
            self.windowed[window] = mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]
        return self.windowed[window]


@dataclass
class _Plan:
    """What every layer of one step reuses: built once per AttentionMetadata."""

    starts: list[int]  # query_start_loc on the host
    decode_rows: list[int]  # requests with one new token
    decode_tokens: list[int]  # their token index in q
    rows: torch.Tensor  # decode_rows as a tensor (the native kernel's row -> request map)
    prefill_rows: torch.Tensor  # int64: the requests with more than one new token
    tokens: torch.Tensor  # decode_tokens as a tensor (the native kernel's row -> token map)
    order: torch.Tensor  # positions within decode_rows, sorted by length
    groups: list[_Group]
    # the native kernels' int32 tables and lengths, made once per step (not once per layer)
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    # the requests with several new tokens that run SDPA (see TorchBackend.sdpa)
    sdpa_rows: list[int] = field(default_factory=list)
    # decode rows sharing a long cached prefix (cascade.py), and the decode rows outside them
    # (requests, their rows in q) for the C++ kernel
    cascades: list[cascade.Cascade] = field(default_factory=list)
    rest_rows: torch.Tensor | None = None
    rest_tokens: torch.Tensor | None = None
    # requests with several new tokens behind a shared prefix (cascade.py), and those outside
    # them for the prefill kernel and SDPA
    extend_cascades: list[cascade.ExtendCascade] = field(default_factory=list)
    prefill_rest: torch.Tensor | None = None
    sdpa_rest: list[int] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return len(self.decode_rows) == len(self.starts) - 1


def _plan(meta: AttentionMetadata, device: torch.device, dtype: torch.dtype,
          groups: bool, sdpa: SdpaRoute | None = None, heads_per_kv: int = 1) -> _Plan:
    p = meta.page_size
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    rows = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    lens = meta.seq_lens_cpu
    order = sorted(range(len(rows)), key=lambda i: lens[rows[i]])
    tokens = [starts[b] for b in rows]
    lens_q = meta.query_lens_cpu
    sdpa_rows = [] if sdpa is None else [b for b, n in enumerate(lens_q) if sdpa.takes(n, lens[b])]
    to_sdpa = set(sdpa_rows)
    plan = _Plan(starts, rows, tokens, torch.tensor(rows, device=device),
                 torch.tensor([b for b, n in enumerate(lens_q) if n > 1 and b not in to_sdpa],
                              dtype=torch.long, device=device),
                 torch.tensor(tokens, dtype=torch.long, device=device),
                 torch.tensor(order, dtype=torch.long, device=device), [],
                 sdpa_rows=sdpa_rows)
    plan.tables = meta.block_tables.to(torch.int32).contiguous()  # no copy if they are already
    plan.lens = meta.seq_lens.to(torch.int32).contiguous()
    if not groups:  # the C++ decode kernel's step: rows that share a long prefix go together
        _plan_cascades(plan, meta, dtype, device, heads_per_kv)
    for g in range(0, len(order) if groups else 0, DECODE_GROUP):
        reqs = [rows[i] for i in order[g : g + DECODE_GROUP]]
        num_blocks = -(-max(lens[b] for b in reqs) // p)
        tables = meta.block_tables[torch.tensor(reqs, device=device), :num_blocks]
        mask = None
        seq = torch.tensor([lens[b] for b in reqs], device=device)
        if min(lens[b] for b in reqs) < num_blocks * p:
            span = torch.arange(num_blocks * p, device=device)
            past_end = span[None, :] >= seq[:, None]
            # additive, in q's dtype: SDPA would otherwise convert a bool mask in every layer
            mask = torch.zeros(past_end.shape, dtype=dtype, device=device)
            mask = mask.masked_fill_(past_end, float("-inf"))[:, None, None, :]
        plan.groups.append(_Group(
            start=g,
            end=g + len(reqs),
            block_ids=tables.clamp(min=0).reshape(-1).long(),  # -1 past the end: masked anyway
            length=num_blocks * p,
            mask=mask,
            seq=seq,
            longest=max(lens[b] for b in reqs),
            windowed={},
        ))
    return plan


def _plan_cascades(plan: _Plan, meta: AttentionMetadata, dtype: torch.dtype,
                   device: torch.device, heads_per_kv: int) -> None:
    """The decode rows and the prompts that share a long prefix (cascade.py), and the rest,
    for the kernels."""
    rows, tokens = plan.decode_rows, plan.decode_tokens
    plan.cascades = cascade.plan_cascades(meta, rows, tokens, dtype)
    if plan.cascades:
        grouped = {int(b) for c in plan.cascades for b in c.requests.tolist()}
        rest = [i for i, b in enumerate(rows) if b not in grouped]
        plan.rest_rows = torch.tensor([rows[i] for i in rest], dtype=torch.long, device=device)
        plan.rest_tokens = torch.tensor([tokens[i] for i in rest], dtype=torch.long,
                                        device=device)
    prompts = [b for b, n in enumerate(meta.query_lens_cpu) if n > 1]
    plan.extend_cascades = cascade.plan_extend_cascades(meta, prompts, plan.starts,
                                                        heads_per_kv, dtype)
    if plan.extend_cascades:
        members = {b for c in plan.extend_cascades for b in c.members}
        plan.prefill_rest = torch.tensor(
            [b for b in plan.prefill_rows.tolist() if b not in members], dtype=torch.long,
            device=device)
        plan.sdpa_rest = [b for b in plan.sdpa_rows if b not in members]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, page_size: int,
            out: torch.Tensor) -> torch.Tensor:
    """The listed blocks of a [num_slots, Hkv, D] cache, back to back, written into the front
    of `out` (a flat workspace): [len(block_ids) * page_size, Hkv, D]."""
    row = page_size * cache.shape[1] * cache.shape[2]
    dst = out[: block_ids.numel() * row].view(-1, row)
    if cache.shape[0] % page_size == 0:
        torch.index_select(cache.view(-1, row), 0, block_ids, out=dst)
    else:
        offsets = torch.arange(page_size, device=cache.device)
        slots = (block_ids[:, None] * page_size + offsets[None, :]).reshape(-1)
        torch.index_select(cache, 0, slots, out=dst.view(-1, *cache.shape[1:]))
    return dst.view(-1, *cache.shape[1:])


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, use_native: bool = False, use_native_prefill: bool = False) -> None:
        self.use_native = use_native  # decodes through the C++ kernel (CPU)
        self.use_native_prefill = use_native_prefill  # prefills and extends through C++ (CPU)
        # With use_native_prefill: the requests `sdpa` takes go to torch's SDPA instead (the
        # model runner sets AMX_BF16 in bfloat16 where the CPU has AMX)
        self.sdpa: SdpaRoute | None = None
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None
        # Gathered K and V land here, reused by every group and layer: a fresh buffer per
        # gather costs page faults, and a reused one stays in cache for the SDPA that reads it.
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, cache: torch.Tensor, num_blocks: int, page_size: int):
        need = num_blocks * page_size * cache.shape[1] * cache.shape[2]
        ws = self._workspace
        if ws is None or ws[0].numel() < need or ws[0].dtype != cache.dtype or (
            ws[0].device != cache.device
        ):
            ws = tuple(torch.empty(need, dtype=cache.dtype, device=cache.device)
                       for _ in range(2))
            self._workspace = ws  # type: ignore[assignment]
        return ws

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None):
        if meta is not self._meta:  # the first layer of a step plans for all of them
            self._meta, self._plan = meta, _plan(
                meta, q.device, q.dtype, not self.use_native,
                self.sdpa if self.use_native_prefill else None, q.shape[1] // k.shape[1])
        plan = self._plan
        assert plan is not None
        cascading = bool(plan.cascades) and window is None
        if plan.decode_only and self.use_native and not cascading:
            # one C++ call: the cache writes and attention
            return self._decode(q, k_cache, v_cache, meta, plan, scale, window, new=(k, v))
        if self.use_native:
            cpu_kernels().write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        if plan.decode_only and not cascading:
            return self._decode(q, k_cache, v_cache, meta, plan, scale, window)
        out = torch.empty_like(q)
        if cascading:
            for c in plan.cascades:
                self._cascade(c, q, k_cache, v_cache, meta.page_size, scale, out)
        if plan.decode_rows and self.use_native:  # straight from q's rows into out's
            self._decode(q, k_cache, v_cache, meta, plan, scale, window, out=out,
                         rest=cascading)
        elif plan.decode_rows:
            tokens = plan.decode_tokens
            out[tokens] = self._decode(q[tokens], k_cache, v_cache, meta, plan, scale, window)
        self._prefill(q, k, v, k_cache, v_cache, meta, plan, scale, window, out)
        return out

    def _extend_cascades(self, q, k_cache, v_cache, plan: _Plan, page_size: int, scale: float,
                         out: torch.Tensor) -> None:
        """The prompts behind a shared prefix (cascade.attend_extend), group by group."""
        for c in plan.extend_cascades:
            longest = max(ids.numel() for ids in c.tail_ids)
            keys, values, kb, vb = self._shared_kv(c.shared_ids, c.shared_start, longest,
                                                   k_cache, v_cache, page_size)

            def tail(ids: torch.Tensor, kb=kb, vb=vb):
                return (_gather(k_cache, ids, page_size, kb), _gather(v_cache, ids, page_size, vb))

            cascade.attend_extend(c, q, keys, values, tail, scale, out)

    def _shared_kv(self, shared_ids: torch.Tensor, shared_start: int | None, tail_blocks: int,
                   k_cache, v_cache, page_size: int):
        """A cascade's shared K and V ([S * page, Hkv, D]: in place when the blocks are
        consecutive, else gathered into the workspace) and the rest of the workspace, room for
        `tail_blocks` blocks of K and of V after them."""
        shared = shared_ids.numel()
        kbuf, vbuf = self._buffers(k_cache, shared + tail_blocks, page_size)
        if shared_start is not None:
            span = slice(shared_start * page_size, (shared_start + shared) * page_size)
            keys, values = k_cache[span], v_cache[span]
        else:
            keys = _gather(k_cache, shared_ids, page_size, kbuf)
            values = _gather(v_cache, shared_ids, page_size, vbuf)
        rest = shared * page_size * k_cache.shape[1] * k_cache.shape[2]
        return keys, values, kbuf[rest:], vbuf[rest:]

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: _Plan,
                 scale: float, window: int | None, out: torch.Tensor) -> None:
        """The requests with several new tokens, written into their rows of `out`."""
        if self.use_native_prefill:
            prefill_rows, requests = plan.prefill_rows, plan.sdpa_rows
            if plan.extend_cascades and window is None:
                self._extend_cascades(q, k_cache, v_cache, plan, meta.page_size, scale, out)
                prefill_rows, requests = plan.prefill_rest, plan.sdpa_rest
            if prefill_rows.numel():
                prefill_kernels().module.paged_prefill(
                    q, k_cache, v_cache, plan.tables, plan.lens,
                    meta.query_start_loc.int(), prefill_rows, meta.page_size, scale,
                    window or 0, out)
        else:
            requests = [b for b, n in enumerate(meta.query_lens_cpu) if n > 1]
        for b in requests:
            n = meta.query_lens_cpu[b]
            s, e = plan.starts[b], plan.starts[b + 1]
            if n == meta.seq_lens_cpu[b]:  # the whole sequence is new: attend to it as it is
                o = _fresh_prompt(q[s:e], k[s:e], v[s:e], scale, window)
            else:
                # 4-D [1, H, n, D]: with 3-D inputs SDPA takes its slow math path on CPU
                o = self._extend(q[s:e].transpose(0, 1)[None], k_cache, v_cache, meta, b, scale,
                                 window)
            out[s:e] = o[0, :, :n].transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, plan: _Plan, scale: float,
                window: int | None, new: tuple[torch.Tensor, torch.Tensor] | None = None,
                out: torch.Tensor | None = None, rest: bool = False):
        """One new token per decode row; q[i] and the result's row i are decode_rows[i]'s.

        Native only: `new` (a decode-only step's k, v) is written to the cache in the same call;
        with `out` (a mixed step, or a step with cascades), q and out are the whole step's rows
        and the kernel reads and writes the decode rows' own (plan.tokens; with `rest`, only
        those outside the cascades)."""
        if self.use_native:
            k, v = new if new is not None else (None, None)
            slots = meta.slot_mapping if new is not None else None
            rows, tokens = (plan.rows, plan.tokens) if out is not None else (None, None)
            if rest:
                rows, tokens = plan.rest_rows, plan.rest_tokens  # planned with the cascades
                if rows.numel() == 0:
                    return out
            return cpu_kernels().decode(q, k_cache, v_cache, plan.tables, plan.lens,
                                        meta.page_size, scale, window or 0, k, v, slots, rows,
                                        tokens, out)
        page_size = meta.page_size
        # rows sorted by length, so that each group is a slice: two index ops per layer in all
        q_sorted = q.index_select(0, plan.order).unsqueeze(2)  # [N, Hq, 1, D]
        out_sorted = torch.empty_like(q)
        kbuf, vbuf = self._buffers(k_cache, max(g.block_ids.numel() for g in plan.groups),
                                   page_size)
        for g in plan.groups:
            shape = (-1, g.length, *k_cache.shape[1:])
            keys = _gather(k_cache, g.block_ids, page_size, kbuf).view(shape).transpose(1, 2)
            values = _gather(v_cache, g.block_ids, page_size, vbuf).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q_sorted[g.start : g.end],
                keys,  # [n, Hkv, length, D], a strided view of the gathered blocks
                values,
                attn_mask=g.mask_for(window, q.dtype),
                scale=scale,
                enable_gqa=True,
            )
            out_sorted[g.start : g.end] = o.squeeze(2)
        return torch.empty_like(q).index_copy_(0, plan.order, out_sorted)

    def _cascade(self, c: cascade.Cascade, q, k_cache, v_cache, page_size: int, scale: float,
                 out: torch.Tensor) -> None:
        """One group of rows sharing a prefix (cascade.py): its blocks and the rows' tails
        gathered into the workspace, one after the other, then attended."""
        keys, values, kb, vb = self._shared_kv(c.shared_ids, c.shared_start, c.tail_ids.numel(),
                                               k_cache, v_cache, page_size)
        tail_keys = _gather(k_cache, c.tail_ids, page_size, kb)
        tail_values = _gather(v_cache, c.tail_ids, page_size, vb)
        cascade.attend(c, q, keys, values, tail_keys, tail_values, scale, out)

    def _extend(self, qh, k_cache, v_cache, meta: AttentionMetadata, b: int, scale: float,
                window: int | None):
        """New tokens of one request after a cached prefix: attend causally to all of it (or
        to what of it lies inside the window)."""
        n, total = qh.shape[2], meta.seq_lens_cpu[b]
        p = meta.page_size
        ids = meta.block_tables[b, : -(-total // p)].long()
        kbuf, vbuf = self._buffers(k_cache, ids.numel(), p)
        keys = _gather(k_cache, ids, p, kbuf)[:total].transpose(0, 1)[None]  # [1, Hkv, total, D]
        values = _gather(v_cache, ids, p, vbuf)[:total].transpose(0, 1)[None]
        qpos = torch.arange(total - n, total, device=qh.device)
        gap = qpos[:, None] - torch.arange(total, device=qh.device)[None, :]
        mask = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
        return F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)


def _fresh_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: int | None) -> torch.Tensor:
    """SDPA of a prompt on its own k, v ([n, H, D] each), causal: [1, Hq, m, D], where rows n..m
    (m >= n, padding) are to be dropped.

    torch's bfloat16 flash kernel on CPU is 1.3-3x slower at lengths that are not a multiple of
    SDPA_PAD than at the next multiple (AMX, 2 cores, SmolLM2's heads: 446 tokens 6.3 ms, padded
    to 448 1.9 ms; docs/benchmarks-history.md), so such prompts are padded with zero rows at the
    end. Under a causal mask no real query sees a padded key, and every padded query sees at
    least itself, so the real rows come out as they would unpadded. float32 gains nothing from
    it."""
    n = q.shape[0]
    m = n
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and n % SDPA_PAD:
        m = -(-n // SDPA_PAD) * SDPA_PAD
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, m - n)) for t in (q, k, v))  # zero rows at the end
    mask = None
    if window is not None and window < n:
        pos = torch.arange(m, device=q.device)
        gap = pos[:, None] - pos[None, :]
        mask = (gap >= 0) & (gap < window)
    # 4-D [1, H, m, D]: with 3-D inputs SDPA takes its slow math path on CPU
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)


# -- the native kernels -------------------------------------------------------------------------




def cpu_kernels():
    """The C++ decode kernel, or None where it cannot be built (see `native_kernels`)."""
    return DECODE.module()


def native_kernels() -> NativeKernels:
    """The kernel and the reason it is absent, built (or found wanting) once per process."""
    return DECODE.kernels()


def prefill_kernels() -> NativeKernels:
    """The C++ prefill/extend kernel and the reason it is absent, built once per process."""
    return PREFILL.kernels()
