"""`tokenline bench roofline`: the fastest a decode step could possibly run on this machine.

It measures the machine's float32 matmul FLOP/s and memory bandwidth, then bounds one decode
step of a model (every running request produces one token) from below:

    time >= max(FLOPs / peak FLOP/s, bytes / bandwidth)

    FLOPs = 2 x (layer matmul params + lm_head params) x batch       one multiply-add per weight
          + 4 x layers x heads x head_dim x context x batch           QK^T and PV over the context
    bytes = 4 x (layer matmul + lm_head + norm params)               every weight read once, fp32
          + 2 x layers x kv_heads x head_dim x context x batch x 4   K and V of the context

The input embedding is a gather of `batch` rows, so an untied embedding table is not counted
as read; a tied one is, once, as the lm_head. Activations are left out: at decode they are
kilobytes next to the weights. The offline benchmark reports our decode as a fraction of this.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

BYTES_FP32 = 4
DEFAULT_BATCHES = (1, 8, 32, 64, 128)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a Llama-family model's decode cost; defaults are SmolLM2-135M."""

    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a transformers config.json of the Llama family."""
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )


def layer_matmul_params(shape: ModelShape) -> int:
    """Weights of every layer's linear maps (q, k, v, o and the SwiGLU gate, up, down)."""
    h, d = shape.hidden_size, shape.head_dim
    attention = h * shape.num_heads * d * 2 + h * shape.num_kv_heads * d * 2
    mlp = 3 * h * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def lm_head_params(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def norm_params(shape: ModelShape) -> int:
    # Two RMSNorms per layer and the final one.
    return (2 * shape.num_layers + 1) * shape.hidden_size


def decode_step_flops(shape: ModelShape, batch: int, context: int) -> int:
    matmul = 2 * (layer_matmul_params(shape) + lm_head_params(shape)) * batch
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context * batch
    return matmul + attention


def decode_step_bytes(shape: ModelShape, batch: int, context: int) -> int:
    weights = BYTES_FP32 * (layer_matmul_params(shape) + lm_head_params(shape) + norm_params(shape))
    kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context * batch * BYTES_FP32
    return weights + kv


def decode_step_bound(
    shape: ModelShape, batch: int, context: int, flops_per_s: float, bytes_per_s: float
) -> float:
    """Lower bound, in seconds, of one decode step of `batch` requests at `context` tokens."""
    return max(
        decode_step_flops(shape, batch, context) / flops_per_s,
        decode_step_bytes(shape, batch, context) / bytes_per_s,
    )


def measure_machine(
    matmul_size: int = 2048,
    bandwidth_mib: int = 512,
    repeats: int = 5,
    threads: int | None = None,
    device: str = "cpu",
) -> tuple[float, float]:
    """(peak float32 matmul FLOP/s, memory bandwidth in bytes/s), best of `repeats` runs.

    Bandwidth is the better of a sum (a pure read stream, what decode does to weights) and a
    copy (read + write); the buffer should be far larger than the last-level cache.
    """
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(device)
        return _matmul_flops(matmul_size, repeats, dev), _bandwidth(bandwidth_mib, repeats, dev)
    finally:
        torch.set_num_threads(old_threads)


def _matmul_flops(size: int, repeats: int, device: torch.device) -> float:
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    out = torch.empty_like(a)
    return 2.0 * size**3 / _best_time(lambda: torch.matmul(a, b, out=out), repeats, device)


def _bandwidth(mib: int, repeats: int, device: torch.device) -> float:
    src = torch.ones(mib * 2**20 // BYTES_FP32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * BYTES_FP32
    read_s = _best_time(lambda: src.sum(), repeats, device)
    copy_s = _best_time(lambda: dst.copy_(src), repeats, device)
    return max(nbytes / read_s, 2 * nbytes / copy_s)


def _best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: thread pool start, page faults, kernel selection
    sync()
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def roofline_table(
    shape: ModelShape,
    batches: list[int] | tuple[int, ...],
    context: int,
    flops_per_s: float,
    bytes_per_s: float,
) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        flops = decode_step_flops(shape, batch, context)
        nbytes = decode_step_bytes(shape, batch, context)
        compute_s, memory_s = flops / flops_per_s, nbytes / bytes_per_s
        bound_s = decode_step_bound(shape, batch, context, flops_per_s, bytes_per_s)
        rows.append({
            "batch": batch,
            "flops": flops,
            "bytes": nbytes,
            "compute_ms": compute_s * 1e3,
            "memory_ms": memory_s * 1e3,
            "bound_ms": bound_s * 1e3,
            "bound_by": "compute" if compute_s >= memory_s else "memory",
            "tokens_per_s": batch / bound_s,
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'batch':>6} {'GFLOP':>9} {'MB':>9} {'compute ms':>11} {'memory ms':>10} "
        f"{'bound ms':>9} {'bound by':>9} {'tok/s bound':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>6} {r['flops'] / 1e9:>9.2f} {r['bytes'] / 1e6:>9.1f} "
            f"{r['compute_ms']:>11.3f} {r['memory_ms']:>10.3f} {r['bound_ms']:>9.3f} "
            f"{r['bound_by']:>9} {r['tokens_per_s']:>12.0f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenline bench roofline",
        description="Measure FLOP/s and memory bandwidth, then bound a decode step from below.",
    )
    p.add_argument("--config", help="a transformers config.json (Llama family)")
    default = ModelShape()
    for field_name, value in asdict(default).items():
        if isinstance(value, bool):
            continue
        p.add_argument(f"--{field_name.replace('_', '-')}", type=int,
                       help=f"overrides the config (default {value}, SmolLM2-135M)")
    p.add_argument("--untied-embeddings", action="store_true",
                   help="the lm_head is a matrix of its own, not the embedding")
    p.add_argument("--context", type=int, default=512, help="tokens each request attends to")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    m = p.add_argument_group("measurement")
    m.add_argument("--threads", type=int, help=f"torch threads (now {torch.get_num_threads()})")
    m.add_argument("--device", default="cpu")
    m.add_argument("--matmul-size", type=int, default=2048)
    m.add_argument("--bandwidth-mib", type=int, default=512)
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--flops", type=float, help="peak GFLOP/s to use instead of measuring")
    m.add_argument("--bandwidth", type=float, help="GB/s to use instead of measuring")
    p.add_argument("--json", help="write the machine, shape and table here")
    return p


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    fields = asdict(ModelShape())
    if args.config:
        fields = asdict(ModelShape.from_config(json.loads(Path(args.config).read_text())))
    for name in fields:
        value = getattr(args, name, None)
        if value is not None and not isinstance(fields[name], bool):
            fields[name] = value
    if args.untied_embeddings:
        fields["tie_word_embeddings"] = False
    return ModelShape(**fields)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = shape_from_args(args)
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except (OSError, KeyError, ValueError) as exc:
        parser.error(f"bad model shape: {exc}")

    if args.flops and args.bandwidth:
        flops, bandwidth = args.flops * 1e9, args.bandwidth * 1e9
    else:
        flops, bandwidth = measure_machine(
            args.matmul_size, args.bandwidth_mib, args.repeats, args.threads, args.device
        )
        flops = args.flops * 1e9 if args.flops else flops
        bandwidth = args.bandwidth * 1e9 if args.bandwidth else bandwidth
    threads = args.threads or torch.get_num_threads()
    print(f"device {args.device}, {threads} threads: float32 matmul {flops / 1e9:.1f} GFLOP/s, "
          f"memory {bandwidth / 1e9:.1f} GB/s")
    params = layer_matmul_params(shape) + lm_head_params(shape) + norm_params(shape)
    print(f"model: {params / 1e6:.1f}M weights read per step ({params * BYTES_FP32 / 1e6:.0f} MB "
          f"fp32), context {args.context}")
    rows = roofline_table(shape, batches, args.context, flops, bandwidth)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": args.device, "threads": threads, "flops_per_s": flops,
            "bytes_per_s": bandwidth, "shape": asdict(shape), "context": args.context,
            "rows": rows,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
