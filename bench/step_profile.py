"""`tokenline bench profile`: where one step's time goes, against the roofline.

On the real SmolLM2 through the scheduler's ModelRunner (and the sampler), for one
`--dtype` and `--quantization`, three steps:

    decode64   64 requests decoding one token each, contexts of 128..384 tokens
    prefill    one 2,048-token prompt, no cached prefix
    decode1    one request decoding one token at a context of 256

Each step is split into

    matmuls      the projections and the lm_head (Linear.forward, CausalLM.logits)
    attention    the attention backend's forward (cache writes and its Python included)
    norms/rope/act  RMSNorm, rotary, the MLP's activation-and-multiply (MLP.forward less its
                 matmuls), and layers.py's fused helpers where the code has them (which also
                 take the residual adds)
    sampling     the sampler on the step's logits (greedy here: an argmax)
    python       the rest: the input tensors' setup, the decoder's Python, embedding, views,
                 the residual adds of code without the fused ops, dispatch between calls

Times come from a run with perf_counter around each of those functions (self time: a
function's time less that of labelled functions inside it; about 1 us per call of the
tool's own, which lands in "python"), alternating with plain runs; the fastest of each is
kept (`wall` the plain one, `timed` the one split). A separate run under torch.profiler
counts the torch ops called from Python per category (`ops`), the tensor allocations
(`allocs`), and the time of the ops outside the labelled functions.

The roofline columns: the matmuls' FLOPs and weight bytes of the step, and the bound
max(FLOPs / peak, bytes / bandwidth) for this machine (bench/roofline.py measures both; pass
--flops/--bandwidth to skip the measurement). The machine may be shared: compare columns of
one run, not runs of different minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/offline.py
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # services/scheduler/__main__.py says why

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.roofline import ModelShape, layer_matmul_params, lm_head_params, measure_machine  # noqa: E402,E501

CATEGORIES = ("matmuls", "attention", "norms/rope/act", "sampling", "python")
# record_function labels the tool puts around the parts it attributes whole
REGION_PREFIX = "tl::"
CPP_PREFIX = "cpp::"  # a call into our C++ ops
# layers.py's helpers for the fused ops (where the profiled code has them)
ELEMENTWISE_HELPERS = ("rms_norm", "add_rms_norm_", "rotary_", "act_and_mul")
# top-level ops outside those regions that only move, view or look up data
GLUE = ("aten::embedding", "aten::index_select", "aten::index", "aten::to", "aten::_to_copy",
        "aten::copy_", "aten::view", "aten::reshape", "aten::split", "aten::split_with_sizes",
        "aten::chunk", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
        "aten::contiguous", "aten::empty", "aten::empty_like", "aten::zeros", "aten::narrow",
        "aten::lift_fresh", "aten::detach", "aten::alias", "aten::as_strided", "aten::clone",
        "aten::t", "aten::transpose", "aten::expand", "aten::resolve_conj",
        "aten::resolve_neg", "aten::item", "aten::_local_scalar_dense", "aten::float",
        "aten::set_", "aten::numpy_T", "aten::permute")
STEPS = ("decode64", "prefill", "decode1")


@dataclass
class StepProfile:
    step: str
    tokens: int
    wall_ms: float  # the fastest plain run
    timed_ms: float  # the fastest timed run, which `ms` splits
    ms: dict[str, float]
    loose_ops_ms: float  # of ms["python"]: torch ops outside the labelled code (profiled)
    ops: int  # torch ops called from Python (top level)
    ops_by_category: dict[str, int]
    allocs: int  # tensor allocations seen by the profiler
    alloc_mb: float  # and their bytes
    matmul_gflop: float
    matmul_mb: float
    matmul_bound_ms: float
    top_ops: list[tuple[str, int, float]] = field(default_factory=list)  # name, calls, ms


class _Labels:
    """Wraps the functions whose time is attributed whole (this tool only): the projections and
    lm_head, the attention backend, and the norm, rotary and activation code of layers.py (what
    the profiled code has of it: before and after the fused ops it differs).

    Timing pass: each wrapped call's self time (its time less that of wrapped calls inside it)
    goes to its category, measured with perf_counter, no profiler. Profiler pass: each call is
    a record_function region, so that ops can be counted per category."""

    def __init__(self, runner) -> None:
        from services.scheduler.core import sampler
        from services.scheduler.models import layers

        self.targets = [(layers.Linear, "forward", "matmuls"),
                        (layers.CausalLM, "logits", "matmuls"),
                        (type(runner.backend), "forward", "attention"),
                        (layers.RMSNorm, "forward", "norms/rope/act"),
                        (layers.Rotary, "rotate_", "norms/rope/act"),
                        (layers.MLP, "forward", "norms/rope/act"),  # self time: activation
                        (sampler, "sample", "sampling")]
        self.targets += [(layers, h, "norms/rope/act") for h in ELEMENTWISE_HELPERS]
        self.ms = dict.fromkeys(CATEGORIES, 0.0)
        self._stack: list[float] = []  # per open call: time spent in wrapped calls inside it

    @contextmanager
    def timing(self):
        def wrapper(fn, category: str):
            stack, ms = self._stack, self.ms

            def timed(*args, **kwargs):
                stack.append(0.0)
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent = (time.perf_counter() - t) * 1e3
                    inner = stack.pop()
                    ms[category] += spent - inner
                    if stack:
                        stack[-1] += spent
            return timed
        with self._patched(wrapper):
            yield

    @contextmanager
    def regions(self):
        """Also makes each call into layers.py's C++ ops an event of its own (CPP_PREFIX): the
        profiler does not see a pybind call, and each is one call from Python like a torch op."""
        from services.scheduler.native import ops

        def wrapper(fn, label: str):
            def labelled(*args, **kwargs):
                with record_function(label):
                    return fn(*args, **kwargs)
            return labelled
        module = getattr(ops, "_ops_module", None)  # code before the fused ops: none
        names = dir(module) if isinstance(module, types.ModuleType) else []
        extra = [(module, name, CPP_PREFIX + name) for name in names
                 if not name.startswith("_") and callable(getattr(module, name))]
        with self._patched(wrapper, REGION_PREFIX, extra):
            yield

    @contextmanager
    def _patched(self, wrapper, prefix: str = "", extra: list | None = None):
        import inspect

        patched = []
        for owner, name, category in [(o, n, prefix + c) for o, n, c in self.targets] + (
            extra or []
        ):
            if not hasattr(owner, name):
                continue
            raw = inspect.getattr_static(owner, name)
            new = wrapper(getattr(owner, name), category)
            setattr(owner, name, staticmethod(new) if isinstance(raw, staticmethod) else new)
            patched.append((owner, name, raw))
        try:
            yield
        finally:
            for owner, name, raw in reversed(patched):
                setattr(owner, name, raw)


def _requests(kind: str, page_size: int):
    """(requests, tokens computed per request) for one step kind, with block tables laid out
    one after another in the pool."""
    from common.messages import SamplingParams
    from services.scheduler.core.request import Request

    if kind == "prefill":
        contexts, new = [0], [2048]
    elif kind == "decode1":
        contexts, new = [256], [1]
    else:
        contexts, new = [128 + (256 * b) // 63 for b in range(64)], [1] * 64
    reqs, block = [], 0
    for b, (ctx, n) in enumerate(zip(contexts, new, strict=True)):
        total = ctx + n
        prompt = [1000 + (7 * i + b) % 30000 for i in range(max(ctx, n))]
        r = Request(f"r{b}", prompt, SamplingParams(temperature=0.0, max_new_tokens=4))
        if ctx:
            r.output_ids = [42]
        r.num_computed = ctx
        blocks = -(-total // page_size)
        r.block_table = list(range(block, block + blocks))
        block += blocks
        reqs.append(r)
    return reqs, new


def _step_fn(runner, kind: str) -> Callable[[], object]:
    from services.scheduler.core import sampler

    reqs, new = _requests(kind, runner.page_size)
    rows = [sampler.SampleRow(r.params, 0, r.num_computed + n, None, None, [])
            for r, n in zip(reqs, new, strict=True)]

    def step():
        logits = runner.forward(reqs, new, [1] * len(reqs))
        return sampler.sample(logits, rows)  # looked up here: _Labels wraps it
    return step


def _count_ops(prof) -> tuple[dict[str, int], float, int, int, list]:
    """From a profiled step: torch ops called from Python per category, the time of those
    outside every labelled region (ms), allocations (count, bytes), the costliest ops."""
    counts = dict.fromkeys(CATEGORIES, 0)
    loose_ms = 0.0
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name == "[memory]" or e.name.startswith(REGION_PREFIX):
            continue  # a C++ op's event (CPP_PREFIX) counts as an op: its torch calls do not
        region, parent, top = None, e.cpu_parent, True
        while parent is not None:  # the innermost region around e, and whether an op encloses e
            if not parent.name.startswith(REGION_PREFIX):
                top = False
            elif region is None:
                region = parent.name.removeprefix(REGION_PREFIX)
            parent = parent.cpu_parent
        if not top:  # called by another op: inside its parent's time and count
            continue
        t = e.time_range.elapsed_us() / 1e3
        counts[region or "python"] += 1
        if region is None:
            loose_ms += t
        by_name.setdefault(e.name, []).append(t)
    mem = [m.nbytes() for m in prof.profiler.kineto_results.events() if m.name() == "[memory]"]
    top_ops = sorted(((n, len(v), round(sum(v), 3)) for n, v in by_name.items()),
                     key=lambda r: -r[2])[:12]
    return counts, loose_ms, sum(b > 0 for b in mem), sum(b for b in mem if b > 0), top_ops


def _roofline(runner, kind: str, shape: ModelShape) -> tuple[float, float]:
    """(matmul FLOPs, weight bytes read) of one step: every projection and the lm_head once."""
    tokens = {"decode64": 64, "prefill": 2048, "decode1": 1}[kind]
    rows = 1 if kind == "prefill" else tokens  # the lm_head runs on sampled rows only
    flops = 2 * layer_matmul_params(shape) * tokens + 2 * lm_head_params(shape) * rows
    nbytes = float(runner.packed_bytes or runner.weight_bytes)
    if runner.linear_backend == "native_bfloat16":
        nbytes /= 2  # our bfloat16 tiles and oneDNN's copy beside them: a call reads one
    return flops, nbytes


def profile_steps(runner, steps: list[str], repeats: int, flops_per_s: float,
                  bytes_per_s: float) -> list[StepProfile]:
    shape = ModelShape.from_config(runner.config)
    out = []
    for kind in steps:
        fn = _step_fn(runner, kind)
        fn()  # warm-up: kernel selection, page faults
        reps = max(2, repeats // 8) if kind == "prefill" else repeats
        wall, best = float("inf"), None
        # plain and timed runs alternate, so that both see the same neighbours on a shared
        # machine; the fastest of each is kept
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            wall = min(wall, time.perf_counter() - t)
            labels = _Labels(runner)
            with labels.timing():
                t = time.perf_counter()
                fn()
                timed = (time.perf_counter() - t) * 1e3
            if best is None or timed < best[0]:
                best = (timed, labels.ms)
        assert best is not None
        timed, ms = best
        labels = _Labels(runner)
        with labels.regions(), profile(activities=[ProfilerActivity.CPU],
                                       profile_memory=True) as prof:
            fn()
        counts, loose_ms, allocs, alloc_bytes, top = _count_ops(prof)
        ms["python"] = max(0.0, timed - sum(ms.values()))
        flops, nbytes = _roofline(runner, kind, shape)
        bound = max(flops / flops_per_s, nbytes / bytes_per_s) * 1e3
        tokens = {"decode64": 64, "prefill": 2048, "decode1": 1}[kind]
        out.append(StepProfile(
            step=kind, tokens=tokens, wall_ms=round(wall * 1e3, 3), timed_ms=round(timed, 3),
            ms={k: round(v, 3) for k, v in ms.items()}, loose_ops_ms=round(loose_ms, 3),
            ops=sum(counts.values()), ops_by_category=counts, allocs=allocs,
            alloc_mb=round(alloc_bytes / 1e6, 2), matmul_gflop=round(flops / 1e9, 3),
            matmul_mb=round(nbytes / 1e6, 1), matmul_bound_ms=round(bound, 3), top_ops=top))
    return out


def compare_torch_ops(runner, steps: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """Each step's fastest wall time with layers.py's C++ ops and with the torch ops they
    replaced (the fallback, switched in by hand), runs alternating in this one process: the
    ratio holds on a shared machine where the absolute times do not."""
    from services.scheduler.native import ops

    built = ops._ops_module
    out = {}
    for kind in steps:
        fn = _step_fn(runner, kind)
        best = {"fused": float("inf"), "torch": float("inf")}
        reps = max(2, repeats // 8) if kind == "prefill" else repeats
        try:
            for _ in range(reps + 1):  # the first round warms both up
                for path in best:
                    ops._ops_module = built if path == "fused" else None
                    t = time.perf_counter()
                    fn()
                    best[path] = min(best[path], time.perf_counter() - t)
        finally:
            ops._ops_module = built
        out[kind] = {"fused_ms": round(best["fused"] * 1e3, 3),
                     "torch_ms": round(best["torch"] * 1e3, 3),
                     "speedup": round(best["torch"] / best["fused"], 3)}
    return out


def format_profiles(profiles: list[StepProfile]) -> str:
    lines = [f"{'step':<9} {'wall ms':>8} {'timed':>8} " + " ".join(f"{c:>14}" for c in CATEGORIES)
             + f" {'ops':>6} {'allocs':>7} {'mm bound':>9}"]
    for p in profiles:
        cells = " ".join(f"{p.ms[c]:>8.2f} {100 * p.ms[c] / p.timed_ms:>4.0f}%" for c in CATEGORIES)
        lines.append(f"{p.step:<9} {p.wall_ms:>8.2f} {p.timed_ms:>8.2f} {cells} {p.ops:>6} "
                     f"{p.allocs:>7} {p.matmul_bound_ms:>9.2f}")
    for p in profiles:
        ops = ", ".join(f"{c} {n}" for c, n in p.ops_by_category.items() if n)
        lines.append(f"\n{p.step}: torch ops per category: {ops} (python: ops outside the "
                     f"labelled code, {p.loose_ops_ms:.2f} ms of its time when profiled)")
        lines.append(f"  matmuls {p.matmul_gflop:.2f} GFLOP over {p.matmul_mb:.0f} MB of weights:"
                     f" bound {p.matmul_bound_ms:.2f} ms, measured {p.ms['matmuls']:.2f} ms; "
                     f"{p.allocs} allocations, {p.alloc_mb:.1f} MB")
        lines.append("  costliest ops (profiled): " + ", ".join(
            f"{n} x{c} {t:.2f} ms" for n, c, t in p.top_ops[:8]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from services.scheduler.models import quant

    p = argparse.ArgumentParser(prog="tokenline bench profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quantization", choices=quant.MODES, default="none")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma-separated, of {', '.join(STEPS)}")
    p.add_argument("--repeats", type=int, default=20,
                   help="unprofiled runs per step for the wall time (prefill: an eighth)")
    p.add_argument("--threads", type=int, help="torch threads (default: all)")
    p.add_argument("--flops", type=float, help="peak GFLOP/s (default: measured)")
    p.add_argument("--bandwidth", type=float, help="GB/s (default: measured)")
    p.add_argument("--compare-torch-ops", action="store_true",
                   help="also time each step with the fused C++ ops and with the torch ops they "
                        "replaced, alternating in this process")
    p.add_argument("--json", help="also write the profiles here")
    return p


def main(argv: list[str] | None = None) -> int:
    from common.modelstore import gguf_source, prepare_model
    from services.scheduler.executor.model_runner import ModelRunner

    parser = build_parser()
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if bad := [s for s in steps if s not in STEPS]:
        parser.error(f"--steps: unknown step {bad[0]!r} (of {', '.join(STEPS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flops and args.bandwidth:
        flops, bandwidth = args.flops * 1e9, args.bandwidth * 1e9
    else:
        flops, bandwidth = measure_machine(threads=args.threads)
        flops = args.flops * 1e9 if args.flops else flops
        bandwidth = args.bandwidth * 1e9 if args.bandwidth else bandwidth
    path = prepare_model(None)
    runner = ModelRunner(path, device="cpu", dtype=args.dtype, quantization=args.quantization,
                         gguf_path=gguf_source(None), max_total_tokens=64 * 400 + 2048 + 64)
    print(f"{runner.architecture}, --dtype {args.dtype} --quantization {args.quantization} "
          f"(activations {str(runner.dtype).removeprefix('torch.')}, linears "
          f"{runner.linear_backend} {str(runner.linear_dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads; machine {flops / 1e9:.0f} GFLOP/s float32, "
          f"{bandwidth / 1e9:.1f} GB/s; load {os.getloadavg()[0]:.1f}")
    profiles = profile_steps(runner, steps, args.repeats, flops, bandwidth)
    print(format_profiles(profiles))
    compared = None
    if args.compare_torch_ops:
        from services.scheduler.native import ops

        if not isinstance(getattr(ops, "_ops_module", None), types.ModuleType):
            parser.error("--compare-torch-ops: the fused C++ ops are not built here")
        compared = compare_torch_ops(runner, steps, args.repeats)
        print("\nfused C++ ops against the torch ops they replaced (fastest wall, alternating):")
        for kind, c in compared.items():
            print(f"  {kind:<9} fused {c['fused_ms']:.2f} ms, torch {c['torch_ms']:.2f} ms: "
                  f"{c['speedup']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "quantization": args.quantization,
                       "threads": torch.get_num_threads(), "flops_per_s": flops,
                       "bytes_per_s": bandwidth, "load": os.getloadavg()[0],
                       "profiles": [asdict(p) for p in profiles],
                       "compare_torch_ops": compared}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
