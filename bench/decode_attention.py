"""`python -m bench.decode_attention`: the C++ decode kernel alone, against memory bandwidth.

One "step" is what a batch-64 SmolLM2 decode step asks of it: one call per layer (30 layers,
each with caches of its own, as the model has), 64 requests at contexts 128..384 (the same as
`bench.step_profile`'s decode64), 9 query heads over 3 KV heads of 64, page 16, q read from
the rows of a qkv projection and the step's new K/V rows written inside the call, exactly as
TorchBackend's decode-only step calls it. The blocks lie one after another per request
(`--layout contiguous`, as step_profile lays them out and a fresh burst's prompts get them) or
shuffled over the pool (`--layout shuffled`, as a long-running server's decode blocks end up);
`--layout hot` points every request at the same few blocks, which then stay in L2: the kernel's
compute alone, with no memory traffic to wait for. `--contexts 4096,7168 --batch 1,4,16` times
long contexts instead: `--batch` requests at each context, as many layers (up to 30) as make
the step's K and V at least 256 MB, far past L3.

Beside the kernel it times a plain streaming read of the same number of bytes (a torch sum over
both threads, over one contiguous tensor as large as a step's K and V): what this machine's
memory gives right now, the bound the kernel is measured against; each kernel's ratio to it
is the median of its rounds' ratios (`this/read`). With --against REV the same
source at that git revision is built as a second extension and the two alternate, round by
round, in this process (the machine may be shared: compare columns of one run). With --steps
(and --against) it also times whole decode64 steps of the real SmolLM2 through
`bench.step_profile` (ModelRunner.forward and the sampler: wall, and the attention backend's
share), switching the runner's kernel between the two builds round by round.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/offline.py
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the scheduler runs: its __main__ says why

import torch  # noqa: E402

from services.scheduler import native  # noqa: E402
from services.scheduler.native import LOCAL_INCLUDE, Extension  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 9, 3, 64, 16, 30
CONTEXTS = [128 + (256 * b) // 63 for b in range(64)]  # step_profile's decode64
LONG_BYTES = 256 * 10**6  # --contexts: a step's K and V at least this (8x a 32 MiB L3)


class Step:
    """Tables, lengths, q/k/v rows and `layers` pairs of caches for one decode step."""

    def __init__(self, dtype: torch.dtype, layout: str, layers: int = LAYERS,
                 seed: int = 0, contexts: list[int] | None = None, page: int = PAGE) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.page = page
        lens = [c + 1 for c in contexts or CONTEXTS]
        need = [-(-n // page) for n in lens]
        blocks = sum(need) + 64  # a little slack, as a pool has
        order = torch.randperm(blocks, generator=gen).tolist() if layout == "shuffled" else list(
            range(blocks))
        self.tables = torch.zeros((len(lens), max(need) + 4), dtype=torch.int32)
        slots, at = [], 0
        for b, n in enumerate(lens):
            self.tables[b, : need[b]] = torch.tensor(order[at : at + need[b]], dtype=torch.int32)
            at += 0 if layout == "hot" else need[b]
            slots.append(int(self.tables[b, (n - 1) // page]) * page + (n - 1) % page)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.slots = torch.tensor(slots)
        qkv = torch.randn(len(lens), HQ + 2 * HKV, D, generator=gen).to(dtype)
        self.q, self.k, self.v = qkv.split([HQ, HKV, HKV], dim=1)
        self.caches = [(torch.randn(blocks * page, HKV, D, generator=gen).to(dtype),
                        torch.randn(blocks * page, HKV, D, generator=gen).to(dtype))
                       for _ in range(layers)]
        self.out = torch.empty(len(lens), HQ, D, dtype=dtype)
        # the K/V bytes the kernel reads per step (positions attended to, both caches)
        self.bytes = sum(lens) * HKV * D * 2 * self.q.element_size() * layers

    def run(self, module) -> None:
        for kc, vc in self.caches:
            module.decode(self.q, kc, vc, self.tables, self.lens, self.page, D**-0.5, 0, self.k,
                          self.v, self.slots, None, None, self.out)


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def source_at(rev: str, kernel: Extension = native.DECODE) -> Path:
    """A kernel's source at git revision `rev`, with the headers it includes at that revision,
    written into a temporary tree laid out as the repository is; the source's path there."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                        cwd=kernel.source.parent, text=True).strip())
    source = kernel.source.resolve().relative_to(root)
    tree = Path(tempfile.mkdtemp(prefix=f"{source.stem}_"))
    todo, written = [source], set()
    while todo:  # the source, then each `#include "..."` file it reaches, at its own place
        rel = todo.pop()
        text = subprocess.check_output(["git", "show", f"{rev}:{rel.as_posix()}"], cwd=root,
                                       text=True)
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
        written.add(rel)
        for name in LOCAL_INCLUDE.findall(text):
            header = Path(os.path.normpath(rel.parent / name))
            if header not in written and header not in todo:
                todo.append(header)
    return tree / source


def build_at(rev: str, kernel: Extension = native.DECODE) -> object:
    """A kernel (the decode kernel's unless told) as it was at git revision `rev`, built as an
    extension of its own."""
    module = Extension(source_at(rev, kernel), f"{kernel.what} at {rev}").module()
    assert module is not None, f"{kernel.what} at {rev} did not build"
    return module


def whole_steps(kernels: dict[str, object], dtype: str, rounds: int, repeats: int) -> None:
    """decode64 through step_profile with each kernel in turn: median wall and attention ms."""
    from bench.step_profile import profile_steps
    from common.modelstore import gguf_source, prepare_model
    from services.scheduler.executor.model_runner import ModelRunner
    from services.scheduler.native import NativeKernels

    runner = ModelRunner(prepare_model(None), device="cpu", dtype=dtype,
                         gguf_path=gguf_source(None), max_total_tokens=64 * 400 + 2048 + 64)
    walls: dict[str, list[float]] = {name: [] for name in kernels}
    attention: dict[str, list[float]] = {name: [] for name in kernels}
    try:
        for _ in range(rounds):
            for name, module in kernels.items():
                native.DECODE._state = NativeKernels(module=module)
                # flops and bandwidth only scale the matmul roofline column, unused here
                prof = profile_steps(runner, ["decode64"], repeats, 1e12, 1e11)[0]
                walls[name].append(prof.wall_ms)
                attention[name].append(prof.ms["attention"])
    finally:
        native.DECODE._state = NativeKernels(module=kernels["this"])
    print(f"decode64 steps, {dtype}, {rounds} rounds of the fastest of {repeats}, median ms: "
          + " | ".join(f"{name} wall {statistics.median(walls[name]):.2f} attention "
                       f"{statistics.median(attention[name]):.2f}" for name in kernels))


def cases(args: argparse.Namespace, dtype: torch.dtype) -> list[tuple[str, list[int], int]]:
    """(label, contexts, layers) of each step to time: decode64 unless --contexts; then each
    context at each --batch, with as many layers (up to the model's 30) as make the caches
    LONG_BYTES, far more than L3 holds, unless --layers says."""
    if not args.contexts:
        return [("", CONTEXTS, args.layers or LAYERS)]
    size = torch.empty(0, dtype=dtype).element_size()
    out = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            per_layer = batch * (context + 1) * HKV * D * 2 * size
            layers = args.layers or max(1, min(LAYERS, -(-LONG_BYTES // per_layer)))
            out.append((f"{context} x {batch:<2} ", [context] * batch, layers))
    return out


def time_step(kernels: dict[str, object], step: Step, rounds: int) -> str:
    """The kernels and a plain read of the same bytes, alternating round by round: each one's
    median (best) ms and GB/s, and each kernel's median ratio to the read of its own round."""
    stream = torch.empty(step.bytes // 4, dtype=torch.float32).normal_()
    results: dict[str, list[float]] = {name: [] for name in [*kernels, "read"]}
    for module in kernels.values():  # warm-up: page faults, OpenMP start
        step.run(module)
    for _ in range(rounds):
        for name, module in kernels.items():
            results[name].append(_time(lambda m=module, s=step: s.run(m)))
        results["read"].append(_time(stream.sum))
    cells = []
    for name, times in results.items():
        med = statistics.median(times)
        cells.append(f"{name} {med:.2f} ({min(times):.2f}) {step.bytes / med / 1e6:.1f} GB/s")
    for name in kernels:
        pairs = zip(results[name], results["read"], strict=True)
        ratio = statistics.median(k / r for k, r in pairs)
        cells.append(f"{name}/read {ratio:.2f}x")
    return " | ".join(cells)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="comma-separated: float32, bfloat16")
    parser.add_argument("--layout", default="contiguous,shuffled",
                        help="comma-separated: contiguous, shuffled, hot")
    parser.add_argument("--contexts", help="comma-separated contexts (e.g. 4096,7168): "
                        "--batch requests at each instead of decode64's 64 short ones")
    parser.add_argument("--batch", default="1,4,16", help="with --contexts: comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--page", default=str(PAGE),
                        help="comma-separated tokens per KV block (the server's --page-size)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--layers", type=int, help=f"calls (layers) per step (default "
                        f"{LAYERS}; with --contexts enough for {LONG_BYTES // 10**6} MB)")
    parser.add_argument("--steps", action="store_true",
                        help="also whole decode64 steps of SmolLM2, per --dtype, each kernel")
    parser.add_argument("--step-rounds", type=int, default=5)
    parser.add_argument("--step-repeats", type=int, default=5,
                        help="runs per step and round, the fastest kept (step_profile's)")
    parser.add_argument("--kernel-rounds", type=int,
                        help="rounds of the kernel alone (default --rounds; 0: skip them)")
    parser.add_argument("--against", metavar="REV",
                        help="also time the kernel's source at this git revision, alternating")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = {"this": native.DECODE.module()}
    assert kernels["this"] is not None, "the CPU decode kernel did not build"
    if args.against:
        kernels[args.against] = build_at(args.against)
    # PASSIVE unless the environment says otherwise (set above); the server runs libgomp's
    # default, which at batch 1 reads 15-40% faster here (docs/benchmarks.md)
    print(f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY') or '(libgomp default)'}, {args.rounds} rounds, "
          f"median (best) ms per step (one call per layer)")
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for layout in args.layout.split(",") if args.kernel_rounds != 0 else []:
            for (label, contexts, layers), page in itertools.product(
                    cases(args, dtype), map(int, args.page.split(","))):
                step = Step(dtype, layout, layers, contexts=contexts, page=page)
                cells = time_step(kernels, step, args.kernel_rounds or args.rounds)
                print(f"{dtype_name:8} {layout:10} page {page:<3} {label}{layers:2} layers "
                      f"{step.bytes / 1e6:.0f} MB: {cells}", flush=True)
                del step
        if args.steps:
            whole_steps(kernels, dtype_name, args.step_rounds, args.step_repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
