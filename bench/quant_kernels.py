"""`python -m bench.quant_kernels`: which CPU kernel runs each weight format fastest.

One run times, on SmolLM2-135M's projection shapes (fused qkv, o, fused gate/up, down, and the
tied lm_head) at batch 1, 7 and 64, every way we can multiply by a weight:

- float32 / bfloat16 through oneDNN from a packed copy (what `--quantization none` runs in
  bfloat16, and in float32 where our tiles do not run);
- ours, float32: the weights in our kernels' tiles through quant_cpu.cpp's float_linear
  (quant.Float32Tiles: what `--quantization none` runs in float32 on AVX-512 CPUs);
- ours: int8 and int4 group-32 weights through services/scheduler/native/quant_cpu.cpp, float32 in
  and out (what `--quantization int8|int4` runs);
- torch's: `torch._weight_int8pack_mm` (int8 per output row) and
  `torch._weight_int4pack_mm_for_cpu` (int4 group 32), with bfloat16 activations, the only
  ones torch vectorizes (its float32 paths measured 28-200x slower): the fallback without a
  compiler;

and prints milliseconds per call and the sum over one decode step (30 layers + lm_head), so
the choice per batch size is one table. With --steps it also times whole decode steps of the
real SmolLM2 (ModelRunner.forward, every request decoding one token at a context of --context)
per --quantization and --dtype. With --from-memory it also times one decode step's matmuls over
distinct weights for every layer (30 of each projection and the lm_head, as the model holds
them), so the weights stream from DRAM as in a real step rather than from the caches the
per-shape table repeats them in: milliseconds and the weight bytes read per second, the
number to hold against the machine's bandwidth at batch 1. With --against REV our int8, int4
and float32-tile columns are also timed with quant_cpu.cpp as it was at git revision REV
(built as an extension of its own, the same weights), alternating in this process: a change's
before and after in one table. With --against REV --float-ab N only the float32 tiles are
timed, REV's build and this tree's alternating call by call for N rounds, and each shape's
median of the per-round ratios is printed, with the largest difference between the two
outputs. The machine it ran on may be shared: compare the columns of one run, not numbers of
different runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/offline.py
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # services/scheduler/__main__.py says why

import torch  # noqa: E402

from services.scheduler import native  # noqa: E402
from services.scheduler.models import quant  # noqa: E402
from services.scheduler.models.layers import onednn_linear, onednn_pack  # noqa: E402

# (name, out_features, in_features, how many per decode step) for SmolLM2-135M
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def _time(fn: Callable[[], object], min_s: float) -> float:
    """Fastest call of at least `min_s` of calls (after a warm-up): on a shared machine the
    median measures the neighbours, the minimum the kernel."""
    for _ in range(3):
        fn()
    times: list[float] = []
    end = time.perf_counter() + min_s
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


AGAINST: dict[str, object] = {}  # --against: revision -> quant_cpu.cpp's module built from it


def _at(module: object, packed: quant.Int8Linear | quant.Int4Linear) -> Callable:
    """x -> out through `module`'s kernel for our packed weight."""
    fn = module.int8_linear if isinstance(packed, quant.Int8Linear) else module.int4_linear
    return lambda x: quant._native_matmul(fn, x, packed.tiles, packed.scale_min,
                                          packed.out_features, packed.in_features)


def _candidates(weight: torch.Tensor) -> dict[str, tuple[Callable, torch.dtype]]:
    """Each kernel as (x -> out, the activation dtype it takes)."""
    f32 = onednn_pack(weight)
    # oneDNN's bfloat16 weights need AVX512 BW/VL/DQ (or AVX-NE-CONVERT): absent on AVX2 CPUs
    bf16 = onednn_pack(weight, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() \
        else None
    int8, int4 = quant.Int8Plain.quantize(weight), quant.Int4Plain.quantize(weight)
    ours8, ours4 = int8.pack(), int4.pack()
    torch8 = quant.TorchInt8Linear.quantize(weight)
    torch4 = quant.TorchInt4Linear.from_plain(int4)
    kernels = {
        "f32_onednn": (lambda x: onednn_linear(x, f32, None), torch.float32),
        "f32_tiles": (quant.Float32Tiles(weight, None).matmul, torch.float32),
        "int8_ours": (ours8.matmul, torch.float32),
        "int4_ours": (ours4.matmul, torch.float32),
        "int8_torch": (torch8.matmul, torch.bfloat16),
        "int4_torch": (torch4.matmul, torch.bfloat16),
    }
    if bf16 is not None:  # bfloat16 in and out, as --dtype bfloat16 runs them
        kernels["bf16_onednn"] = (lambda x: onednn_linear(x, bf16, None), torch.bfloat16)
    if quant.bf16_tiles_missing([weight.shape[1]]) is None:
        kernels["bf16_tiles"] = (quant.Bf16Tiles(weight, None).matmul, torch.bfloat16)
    tiles = quant.Float32Tiles(weight, None)
    for rev, module in AGAINST.items():
        if hasattr(module, "float_linear"):  # the float32 tiles came in 699eafb
            kernels[f"f32_tiles_{rev}"] = (_float_at(module, tiles), torch.float32)
        kernels[f"int8_{rev}"] = (_at(module, ours8), torch.float32)
        kernels[f"int4_{rev}"] = (_at(module, ours4), torch.float32)
    return kernels


def _float_at(module: object, tiles: quant.Float32Tiles) -> Callable:
    """x -> out through `module`'s float32 tiles kernel for our tiled weight."""
    return lambda x: module.float_linear(x, tiles.tiles, None, tiles.out_features)


def run(batches: list[int], min_s: float) -> dict:
    torch.manual_seed(0)
    table: dict = {"threads": torch.get_num_threads(), "batches": {}}
    for batch in batches:
        rows: dict[str, dict[str, float]] = {}
        step: dict[str, float] = {}
        for name, n, k, count in SHAPES:
            weight = torch.randn(n, k) * 0.02
            x = torch.randn(batch, k)
            rows[name] = {}
            for kernel, (fn, dtype) in _candidates(weight).items():
                xin = x.to(dtype)
                ms = _time(lambda fn=fn, xin=xin: fn(xin), min_s) * 1e3
                rows[name][kernel] = round(ms, 4)
                step[kernel] = step.get(kernel, 0.0) + ms * count
        table["batches"][batch] = {
            "per_call_ms": rows,
            "decode_step_ms": {k: round(v, 3) for k, v in step.items()},
            "fastest": min(step, key=step.get),
        }
    return table


def _layer_weights(layers: list[tuple[int, int]]) -> tuple[list, list, list, list, dict]:
    """A random weight per (n, k) as oneDNN float32, float32 tiles, int8 and int4 (the last
    layer, the lm_head, int8 in the int4 list: quantize_model keeps it so), and where this CPU
    runs them, bfloat16 through oneDNN and our bfloat16 tiles (name -> list)."""
    f32, tiles, int8, int4 = [], [], [], []
    bf16: dict[str, list] = {}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16["bf16_onednn"] = []
    if quant.bf16_tiles_missing([k for _, k in layers]) is None:
        bf16["bf16_tiles"] = []
    for i, (n, k) in enumerate(layers):
        weight = torch.randn(n, k) * 0.02
        f32.append(onednn_pack(weight))
        tiles.append(quant.Float32Tiles(weight, None))
        int8.append(quant.Int8Plain.quantize(weight).pack())
        int4.append(int8[-1] if i == len(layers) - 1 else quant.Int4Plain.quantize(weight).pack())
        if "bf16_onednn" in bf16:
            packed = onednn_pack(weight, torch.bfloat16)
            bf16["bf16_onednn"].append(lambda x, w=packed: onednn_linear(x, w, None))
        if "bf16_tiles" in bf16:
            bf16["bf16_tiles"].append(quant.Bf16Tiles(weight, None).matmul)
    return f32, tiles, int8, int4, bf16


def from_memory(batches: list[int], rounds: int = 4) -> dict:
    """Fastest whole step's matmuls (ms) and weight GB/s per kernel, each layer its own weight;
    the kernels alternate in rounds. int4 keeps the lm_head int8 as quantize_model does."""
    torch.manual_seed(0)
    layers = [(n, k) for _ in range(30) for _, n, k, count in SHAPES if count > 1]
    layers.append(next((n, k) for name, n, k, _ in SHAPES if name == "lm_head"))
    f32, tiles, int8, int4, bf16 = _layer_weights(layers)
    weights = {"f32_onednn": 4 * sum(n * k for n, k in layers),
               "f32_tiles": sum(t.nbytes for t in tiles),
               "int8_ours": sum(q.nbytes for q in int8), "int4_ours": sum(q.nbytes for q in int4)}
    weights.update(dict.fromkeys(bf16, 2 * sum(n * k for n, k in layers)))
    revs: dict[str, tuple[list, str]] = {}  # --against: name -> (per-layer x -> out, its bytes)
    for rev, module in AGAINST.items():
        if hasattr(module, "float_linear"):  # the float32 tiles came in 699eafb
            revs[f"f32_tiles_{rev}"] = ([_float_at(module, t) for t in tiles], "f32_tiles")
        revs[f"int8_{rev}"] = ([_at(module, q) for q in int8], "int8_ours")
        revs[f"int4_{rev}"] = ([_at(module, q) for q in int4], "int4_ours")
    weights.update({name: weights[ours] for name, (_, ours) in revs.items()})
    ks = [k for _, k in layers]

    def f32_step(xs: dict) -> None:
        for k, w in zip(ks, f32, strict=True):
            onednn_linear(xs[k], w, None)

    def quant_step(xs: dict, qs: list) -> None:
        for k, q in zip(ks, qs, strict=True):
            q.matmul(xs[k])

    def rev_step(xs: dict, fns: list) -> None:
        for k, fn in zip(ks, fns, strict=True):
            fn(xs[k])

    out: dict = {}
    for batch in batches:
        xs = {k: torch.randn(batch, k) for k in set(ks)}
        steps = {"f32_onednn": partial(f32_step, xs), "f32_tiles": partial(quant_step, xs, tiles),
                 "int8_ours": partial(quant_step, xs, int8),
                 "int4_ours": partial(quant_step, xs, int4)}
        steps.update({name: partial(rev_step, xs, fns) for name, (fns, _) in revs.items()})
        xs_bf16 = {k: x.to(torch.bfloat16) for k, x in xs.items()}
        steps.update({name: partial(rev_step, xs_bf16, fns) for name, fns in bf16.items()})
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(rounds):
            for name, step in steps.items():
                best[name] = min(best[name], _time(step, 0.0))
        out[batch] = {name: {"ms": round(t * 1e3, 2),
                             "weight_GB_s": round(weights[name] / t / 1e9, 1)}
                      for name, t in best.items()}
    return out


def decode_steps(batches: list[int], context: int, min_s: float) -> dict:
    """Fastest whole decode step (ms) of SmolLM2 per (quantization, dtype) and batch size."""
    from common.messages import SamplingParams
    from common.modelstore import gguf_source, prepare_model
    from services.scheduler.core.request import Request
    from services.scheduler.executor.model_runner import ModelRunner

    path = prepare_model(None)
    out: dict = {}
    for q in quant.MODES:
        for dtype in ("float32", "bfloat16"):
            runner = ModelRunner(path, device="cpu", dtype=dtype, quantization=q,
                                 gguf_path=gguf_source(None),
                                 max_total_tokens=max(batches) * (context + 16))
            per_req = -(-(context + 1) // runner.page_size)
            row: dict[int, float] = {}
            for batch in batches:
                reqs = []
                for b in range(batch):
                    r = Request(f"r{b}", list(range(1000, 1000 + context)), SamplingParams())
                    r.output_ids = [42]
                    r.num_computed = context
                    r.block_table = list(range(b * per_req, (b + 1) * per_req))
                    reqs.append(r)
                ms = _time(lambda reqs=reqs, m=runner: m.forward(reqs, [1] * len(reqs),
                                                       [1] * len(reqs)), min_s)
                row[batch] = round(ms * 1e3, 2)
            out[f"{q}/{dtype}"] = row
    return out


def float_ab(rev: str, module: object, batches: list[int], rounds: int) -> None:
    """REV's float32 tiles against this tree's, alternating round by round on the same
    weights: per shape the median of the per-round ratios (REV / ours: above 1, ours is
    faster), and a step's matmuls as the sum of each side's median."""
    ours = native.QUANT.module()
    torch.manual_seed(0)
    print(f"float32 tiles, {rev} / this tree, median of {rounds} rounds "
          f"(threads {torch.get_num_threads()})")
    for batch in batches:
        cells, total = [], {rev: 0.0, "ours": 0.0}
        for name, n, k, count in SHAPES:
            tiles = quant.Float32Tiles(torch.randn(n, k) * 0.02, None)
            x = torch.randn(batch, k)
            calls = {rev: partial(module.float_linear, x, tiles.tiles, None, n),
                     "ours": partial(ours.float_linear, x, tiles.tiles, None, n)}
            diff = (calls[rev]() - calls["ours"]()).abs().max().item()
            reps = max(1, int(2e8 / (2 * batch * n * k)))  # 0.1-1 s a round
            ms: dict[str, list[float]] = {rev: [], "ours": []}
            for _ in range(rounds):
                for side, fn in calls.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    ms[side].append((time.perf_counter() - t) / reps * 1e3)
            ratio = statistics.median(a / b for a, b in zip(ms[rev], ms["ours"], strict=True))
            for side in total:
                total[side] += statistics.median(ms[side]) * count
            cells.append(f"{name} {ratio:.2f}x (max diff {diff:.1e})")
        print(f"  batch {batch}: " + ", ".join(cells) + f"; step's matmuls {total[rev]:.2f} / "
              f"{total['ours']:.2f} ms ({total[rev] / total['ours']:.3f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_kernels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 7, 64])
    parser.add_argument("--min-seconds", type=float, default=0.3,
                        help="time each kernel and shape for at least this long")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--steps", action="store_true",
                        help="also time whole SmolLM2 decode steps per quantization and dtype")
    parser.add_argument("--context", type=int, default=256, help="--steps: tokens per request")
    parser.add_argument("--from-memory", action="store_true",
                        help="also time a step's matmuls over distinct weights per layer (DRAM)")
    parser.add_argument("--against", metavar="REV",
                        help="also time our kernels as quant_cpu.cpp was at this git revision")
    parser.add_argument("--float-ab", type=int, metavar="ROUNDS",
                        help="with --against: only the float32 tiles, REV's and ours "
                             "alternating for ROUNDS rounds, median ratios")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    if args.float_ab and not args.against:
        parser.error("--float-ab needs --against REV")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against:
        from bench.decode_attention import build_at

        AGAINST[args.against] = build_at(args.against, native.QUANT)
        if args.float_ab:
            float_ab(args.against, AGAINST[args.against], args.batches, args.float_ab)
            return
    table = run(args.batches, args.min_seconds)
    if args.steps:
        table["decode_step_ms"] = decode_steps(args.batches, args.context, args.min_seconds)
    if args.from_memory:
        table["from_memory"] = from_memory(args.batches)
    if args.json:
        print(json.dumps(table, indent=2))
        return
    print_table(table, args.batches)


def print_table(table: dict, batches: list[int]) -> None:
    print(f"threads: {table['threads']}")
    for batch, res in table["batches"].items():
        kernels = list(res["decode_step_ms"])
        print(f"\nbatch {batch}: ms per call" + "".join(f"{k:>13}" for k in kernels))
        for name, row in res["per_call_ms"].items():
            print(f"  {name:<22}" + "".join(f"{row[k]:>13.4f}" for k in kernels))
        print(f"  {'decode step (sum)':<22}"
              + "".join(f"{res['decode_step_ms'][k]:>13.3f}" for k in kernels))
        print(f"  fastest: {res['fastest']}")
    if "decode_step_ms" in table:
        print("\nSmolLM2 decode step, ms (quantization/dtype: " + ", ".join(
            f"batch {b}" for b in batches) + ")")
        for name, row in table["decode_step_ms"].items():
            print(f"  {name:<18}" + "".join(f"{row[b]:>10.2f}" for b in batches))


    if "from_memory" in table:
        print("\nOne decode step's matmuls, every layer its own weight (from DRAM): "
              "ms, weight GB/s")
        for batch, row in table["from_memory"].items():
            print(f"  batch {batch:<4}" + "".join(
                f"  {name} {r['ms']:8.2f} ms {r['weight_GB_s']:6.1f} GB/s"
                for name, r in row.items()))


if __name__ == "__main__":
    main()
