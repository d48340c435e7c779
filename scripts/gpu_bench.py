"""Decode-step speed of the Triton attention backend inside a minimal random-weight Llama.

How close does one decode step come to the HBM bound? A decode step has to read every
weight once and every sequence's whole KV cache once, so

    bound = (weight bytes + KV bytes read) / HBM bandwidth

and the fraction reported is bound / measured. The model is our own few lines of torch
(RMSNorm, RoPE, GQA through TritonBackend, SwiGLU) with random weights, so the numbers
depend on nothing but the kernels and cuBLAS; it does not use the project's model code.

    python scripts/gpu_bench.py                       # H200 defaults, markdown table
    python scripts/gpu_bench.py --bandwidth-tbs 3.35  # H100 SXM
    TRITON_INTERPRET=1 python scripts/gpu_bench.py --device cpu --smoke  # CPU plumbing check
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.attention.base import AttentionMetadata  # noqa: E402
from services.scheduler.attention.triton_backend import TritonBackend  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    rope_theta: float


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, True, 100000.0),
    "llama3-8b": Shape("Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
}


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden], fused like vLLM's QKVParallel
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    k_cache: torch.Tensor  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor


class RandomLlama:
    """Just enough of a Llama to run decode steps over a paged KV cache."""

    def __init__(self, shape: Shape, num_slots: int, dtype: torch.dtype, device: str) -> None:
        self.shape = shape
        s = shape

        def weight(rows: int, cols: int) -> torch.Tensor:
            # 1/sqrt(fan-in) keeps activations O(1) through 30+ layers, so no inf/NaN.
            return torch.randn(rows, cols, dtype=dtype, device=device).mul_(cols**-0.5)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=dtype, device=device)

        def cache() -> torch.Tensor:
            return torch.randn(num_slots, s.kv_heads, s.head_dim, dtype=dtype, device=device)

        self.embed = weight(s.vocab, s.hidden)
        self.lm_head = self.embed if s.tie_embeddings else weight(s.vocab, s.hidden)
        self.final_norm = ones(s.hidden)
        self.layers = [
            Layer(
                attn_norm=ones(s.hidden),
                qkv=weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
                o=weight(s.hidden, s.heads * s.head_dim),
                mlp_norm=ones(s.hidden),
                gate_up=weight(2 * s.intermediate, s.hidden),
                down=weight(s.hidden, s.intermediate),
                k_cache=cache(),
                v_cache=cache(),
            )
            for _ in range(s.layers)
        ]
        half = s.head_dim // 2
        inv_freq = 1.0 / s.rope_theta ** (torch.arange(half, device=device).float() / half)
        self.inv_freq = inv_freq
        self.backend = TritonBackend()
        self.scale = s.head_dim**-0.5

    def weight_bytes(self) -> int:
        """Bytes a decode step reads from weights (the embedding lookup reads only B rows)."""
        mats = [self.lm_head, self.final_norm]
        for layer in self.layers:
            mats += [layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down]
        return sum(m.numel() * m.element_size() for m in mats)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = freqs.cos()[:, None, :].to(x.dtype)
        sin = freqs.sin()[:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # HF's rotate_half convention
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One forward over the packed new tokens; returns the greedy next tokens."""
        s = self.shape
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        h = self.embed[tokens]
        for layer in self.layers:
            x = F.rms_norm(h, (s.hidden,), layer.attn_norm, 1e-5)
            q, k, v = F.linear(x, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
            q = self.rope(q.view(-1, s.heads, s.head_dim), positions)
            k = self.rope(k.view(-1, s.kv_heads, s.head_dim), positions)
            v = v.view(-1, s.kv_heads, s.head_dim)
            attn = self.backend.forward(q, k, v, layer.k_cache, layer.v_cache, meta, self.scale)
            h = h + F.linear(attn.flatten(1), layer.o)
            x = F.rms_norm(h, (s.hidden,), layer.mlp_norm, 1e-5)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = F.rms_norm(h, (s.hidden,), self.final_norm, 1e-5)
        return F.linear(h, self.lm_head).argmax(dim=-1)


def decode_batch(
    batch: int, context: int, page_size: int, device: str
) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Metadata for one decode step of `batch` requests at `context` tokens (new one included).

    Blocks are handed out from a shuffled pool, as they are after a while of serving.
    """
    blocks_per_seq = -(-context // page_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).to(torch.int32)
    last = context - 1
    slots = tables[:, last // page_size].long() * page_size + last % page_size
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
        page_size=page_size,
    )
    positions = torch.full((batch,), last, dtype=torch.int64, device=device)
    return meta, positions, num_blocks * page_size


def ms_per_call(fn: Callable[[], object], steps: int, device: str) -> float:
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) * 1e3 / steps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def bench_one(shape: Shape, batch: int, args: argparse.Namespace) -> dict[str, str]:
    device = args.device
    meta, positions, num_slots = decode_batch(batch, args.context, args.page_size, device)
    model = RandomLlama(shape, num_slots, args.dtype, device)
    tokens = torch.randint(0, shape.vocab, (batch,), device=device)

    def step() -> torch.Tensor:
        # Same step every time (same slots rewritten), so the measured work never drifts.
        return model.step(tokens, positions, meta)

    for _ in range(args.warmup):
        step()
    eager_ms = ms_per_call(step, args.steps, device)
    graph_ms = None
    if device == "cuda" and not args.no_graph:
        # Small batches are launch-bound in eager mode; a CUDA graph shows the kernels' own
        # speed, as a serving engine's captured decode would.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        graph_ms = ms_per_call(graph.replay, args.steps, device)

    element = torch.tensor([], dtype=args.dtype).element_size()
    kv_bytes = 2 * shape.layers * batch * args.context * shape.kv_heads * shape.head_dim * element
    weight_bytes = model.weight_bytes()
    bound_ms = (weight_bytes + kv_bytes) / (args.bandwidth_tbs * 1e12) * 1e3
    best_ms = graph_ms if graph_ms is not None else eager_ms
    splits, _ = model.backend.plan_splits(batch, shape.kv_heads, args.context,
                                          torch.device(device))
    return {
        "model": shape.name,
        "batch": str(batch),
        "context": str(args.context),
        "splits": str(splits),
        "weights GB": f"{weight_bytes / 1e9:.3f}",
        "KV read GB": f"{kv_bytes / 1e9:.3f}",
        "bound ms": f"{bound_ms:.3f}",
        "eager ms": f"{eager_ms:.3f}",
        "graph ms": "-" if graph_ms is None else f"{graph_ms:.3f}",
        "% of bound": f"{100 * bound_ms / best_ms:.1f}",
        "tok/s": f"{batch * 1e3 / best_ms:,.0f}",
    }


def markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row[c] for c in head) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama3-8b",
                        help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens per request")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=dtypes, default="bf16")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8,
                        help="device HBM bandwidth in TB/s (H200: 4.8, H100 SXM: 3.35)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-graph", action="store_true", help="time eager steps only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true",
                        help="2 layers, small vocab, short context: checks the plumbing only")
    args = parser.parse_args()
    args.dtype = dtypes[args.dtype]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (for a CPU plumbing check: TRITON_INTERPRET=1 ... "
                 "--device cpu --smoke)")
    shapes = [SHAPES[name] for name in args.models.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        shapes = [replace(s, layers=2, vocab=512) for s in shapes]
        batches = [min(b, 2) for b in batches[:2]]
        args.context = min(args.context, 80)
        args.steps, args.warmup = 1, 1
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, assumed HBM {args.bandwidth_tbs} TB/s")
    rows = []
    for shape in shapes:
        for batch in batches:
            rows.append(bench_one(shape, batch, args))
            if args.device == "cuda":
                # The last model's weights and caches are garbage now; give the memory back
                # before the next one allocates (Llama-3-8B at batch 128 needs ~35 GB).
                torch.cuda.empty_cache()
    print(markdown(rows))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
