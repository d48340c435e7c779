"""Shared fixtures: the real nats-server, the real SmolLM2, a tiny random Llama, whole stacks."""

from __future__ import annotations

import os

# The suite's processes (this one, and every service the tests start, which inherit it) keep
# 4 KiB pages: a scheduler's 2 MiB pages (services/scheduler/__main__.py) cost its start 11 s
# of kernel memory compaction on a VM with fragmented memory (a stack ready in 18 s against
# 7 s), dozens of times a run, and change no output. Set before torch is imported: c10 reads
# it once. The test of resident memory runs with them, as a scheduler does.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")

# Triton kernels run on the CPU interpreter when there is no GPU; this must be set before any
# test module imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A C++ decode kernel that should build and does not is an error here (services started by the
# tests inherit it), not a silent fall back to torch; a machine without a compiler still skips.
os.environ.setdefault("TOKENLINE_CPU_KERNELS", "require")

from collections import Counter  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import make_tiny_llama  # noqa: E402

# Calls into each fast path made in this process (engine tests, kernel tests), for the summary
# line: a path that silently fell back to plain torch shows up as missing from it.
FAST_PATH_CALLS: Counter[str] = Counter()


def _count_fast_paths() -> None:
    from services.scheduler.attention import cascade, triton_backend
    from services.scheduler.attention.torch_backend import TorchBackend
    from services.scheduler.models import layers, linear, lora, quant
    from services.scheduler.native import ops

    def count(name: str, fn):
        def counted(*args, **kwargs):
            FAST_PATH_CALLS[name(*args)] += 1
            return fn(*args, **kwargs)
        return counted

    TorchBackend._decode = count(
        lambda self, *_: "C++ decode kernel" if self.use_native else "torch decode (the fallback)",
        TorchBackend._decode)
    TorchBackend._prefill = count(
        lambda self, *_: ("C++ prefill kernel" if self.use_native_prefill
                          else "torch prefill (the fallback)"),
        TorchBackend._prefill)
    def onednn(x, packed, *_):
        return f"oneDNN {str(packed.dtype).removeprefix('torch.')} linears"

    linear.onednn_linear = count(onednn, linear.onednn_linear)  # the projections
    layers.onednn_linear = count(onednn, layers.onednn_linear)  # the lm_head

    def fused(what: str):
        return lambda x, *_: (f"C++ fused {what}" if ops.fused_ops(x) is not None
                              else f"torch {what} (the fallback)")

    layers.add_rms_norm_ = count(lambda residual, x, *_: fused("add+RMSNorm")(x),
                                 layers.add_rms_norm_)
    layers.rotary_ = count(fused("rotary"), layers.rotary_)
    layers.act_and_mul = count(fused("act-and-mul"), layers.act_and_mul)
    quant.Int8Linear.matmul = count(lambda *_: "C++ int8 linears", quant.Int8Linear.matmul)
    quant.Int4Linear.matmul = count(lambda *_: "C++ int4 linears", quant.Int4Linear.matmul)
    quant.Float32Tiles.matmul = count(lambda *_: "C++ float32 tile linears",
                                      quant.Float32Tiles.matmul)
    quant.Bf16Tiles.matmul = count(
        lambda self, x: ("oneDNN bfloat16 linears" if self.onednn is not None
                         and x.numel() // x.shape[-1] > self.rows else "C++ bfloat16 tile linears"),
        quant.Bf16Tiles.matmul)
    quant.TorchInt8Linear.matmul = count(lambda *_: "torch int8 linears (the fallback)",
                                         quant.TorchInt8Linear.matmul)
    quant.TorchInt4Linear.matmul = count(lambda *_: "torch int4 linears (the fallback)",
                                         quant.TorchInt4Linear.matmul)
    lora.kernel_add = count(lambda *_: "C++ LoRA kernel", lora.kernel_add)
    lora.torch_add = count(lambda *_: "torch LoRA (prefill rows, or the fallback)",
                           lora.torch_add)
    cascade.attend = count(lambda *_: "torch flash cascade decode (shared prefixes)",
                           cascade.attend)
    triton_backend.TritonBackend.forward = count(
        lambda self, q, *_: f"Triton attention ({'CUDA' if q.is_cuda else 'interpreter'})",
        triton_backend.TritonBackend.forward)


def pytest_configure(config) -> None:
    _count_fast_paths()


# The files that take longest (`--durations` of a whole run: a minute or more each), first:
# `-n 2 --dist loadfile` hands files out in collection order, and one of these picked up last
# leaves the other worker idle for its whole length at the end of the run.
SLOWEST_FILES = (
    "test_gemma3.py", "test_quantized_engine.py", "test_hardening_api.py", "test_scale_out.py",
    "test_speculative_engine.py", "test_structured_outputs_smollm2.py", "test_prefix_cache.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Every end-to-end test starts a stack: marked so, `make test-fast` leaves them out."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.stack)
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others keep order


def _kernel_states() -> dict[str, str]:
    """Each C++ extension's state in this process: built, missing (why), or failed."""
    from services.scheduler import native

    def built(ext) -> str:
        state = ext.state
        if state is None:
            return "not asked for in this process"
        if state.module is not None:
            return "built"
        return state.missing or f"BUILD FAILED: {state.error[:300]}"

    return {ext.what: built(ext) for ext in native.EXTENSIONS}


# Under pytest-xdist the tests run in worker processes: each sends its counts and kernel states
# back when it finishes, and the controller's summary line adds them up.
WORKER_KERNELS: dict[str, set[str]] = {}


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a worker
        workeroutput["fast_paths"] = dict(FAST_PATH_CALLS)
        workeroutput["kernels"] = _kernel_states()


def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    FAST_PATH_CALLS.update(output.get("fast_paths", {}))
    for what, state in output.get("kernels", {}).items():
        WORKER_KERNELS.setdefault(what, set()).add(state)


def pytest_terminal_summary(terminalreporter) -> None:
    """One line CI shows: which fast paths this run exercised, and why a kernel is absent."""
    states = {what: {state} for what, state in _kernel_states().items()}
    if WORKER_KERNELS:  # the workers' states are the ones that count; "not asked" only if none
        states = {what: (seen - {"not asked for in this process"} or seen)
                  for what, seen in WORKER_KERNELS.items()}
    calls = ", ".join(f"{name} x{n}" for name, n in sorted(FAST_PATH_CALLS.items())) or "none"
    kernels = "; ".join(f"{what}: {' / '.join(sorted(seen))}" for what, seen in states.items())
    terminalreporter.write_line(f"fast paths exercised in-process: {calls} ({kernels})")


@pytest.fixture(scope="session")
def smol_path():
    from common.modelstore import prepare_model

    return prepare_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_path):
    """A random-weight Llama with SmolLM2's tokenizer: fast enough for engine tests."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol_path)


@pytest.fixture(scope="module")
def nats_server():
    from services.launcher.nats import NatsServer

    server = NatsServer().start()
    yield server
    server.stop()
