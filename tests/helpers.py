"""Test helpers: a tiny model, an in-process engine, and whole stacks in subprocesses."""

from __future__ import annotations

from pathlib import Path

from bench.families import save_with_tokenizer
from bench.servers import TokenlineServer, free_port, wait_healthy  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[1]


def portable_build(source: Path, what: str):
    """A C++ kernel source built as an AVX2-only CPU (CI) builds it: AVX-512 switched off
    (-mno-avx512f, an x86 flag), its own build next to the suite's; on a CPU without AVX-512,
    the suite's own build. NativeKernels."""
    from services.scheduler import native

    if "avx512f" not in native.cpu_flags():
        # -march=native builds no AVX-512 here already: the suite's own build is the portable
        # one, and a second build of the same code would take a minute or two for nothing
        return next(e for e in native.EXTENSIONS if e.source == source).kernels()
    flags = native.CFLAGS
    native.CFLAGS = [*flags, "-mno-avx512f"]
    extension = native.Extension(source, what)
    try:
        return extension.kernels()
    finally:
        native.CFLAGS = flags
        native.EXTENSIONS.remove(extension)


def make_tiny_llama(target: Path, tokenizer_from: Path, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
               rope_theta=10000.0)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return save_with_tokenizer(model, target, tokenizer_from)


def engine_args(model: Path, **kw):
    from common.config import ServerArgs

    kw.setdefault("max_total_tokens", 8192)
    return ServerArgs(model=str(model), **kw)


def run_engine(engine, reqs, max_steps: int = 100000):
    """Drive an EngineCore until idle; returns rid -> (token ids, finish) and the step count."""
    tokens: dict[str, list[int]] = {r.rid: [] for r in reqs}
    finish = {}
    for r in reqs:
        engine.submit(r)
    steps = 0
    while engine.has_work() and steps < max_steps:
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish is not None:
                finish[out.rid] = out.finish
        steps += 1
    return tokens, finish, steps


# The KV pool of a test stack that does not size its own. The default (--cpu-memory-gib 4:
# 2.76 GiB for SmolLM2) costs a scheduler's start 10-20 s on a VM whose memory is fragmented:
# the scheduler asks for 2 MiB pages (its __main__), and the kernel compacts memory for each
# on first touch. No test needs more than this unless it says so.
TEST_KV_TOKENS = "16384"


class Stack(TokenlineServer):
    """`tokenline serve` in a subprocess, with its own embedded NATS server."""

    def __init__(self, *flags: str, env: dict | None = None, timeout: float = 120) -> None:
        if not {"--max-total-tokens", "--cpu-memory-gib"} & set(flags):
            flags = (*flags, "--max-total-tokens", TEST_KV_TOKENS)
        super().__init__(*flags, env=env, timeout=timeout)


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text, parsed with prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)
