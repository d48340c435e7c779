"""The engine with `--attention-backend triton` (the CPU interpreter here, CUDA where there is
one) gives the torch backend's greedy tokens, through prefill, chunks, prefix hits and decode."""

from __future__ import annotations

import os

import pytest
import torch

from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args, run_engine

# compiled kernels on a GPU; Triton's interpreter on CPU tensors otherwise (tests/conftest.py
# sets TRITON_INTERPRET=1 where there is no CUDA)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA, and TRITON_INTERPRET is not 1",
)


def _reqs():
    prompts = [list(range(1000, 1011)), list(range(2000, 2030)), list(range(1000, 1020)) + [7]]
    return [TokenizedReq(rid=f"t{i}", gateway_id="g", input_ids=p,
                         params=SamplingParams(max_new_tokens=6, temperature=0.0,
                                               ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_model_dir):
    flags = dict(page_size=16, chunked_prefill_size=12, max_total_tokens=1024, device=DEVICE,
                 dtype="float32")
    hit = TokenizedReq(rid="hit", gateway_id="g", input_ids=list(range(2000, 2030)) + [9, 9],
                       params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    results = {}
    for backend in ("torch", "triton"):
        engine = EngineCore(engine_args(tiny_model_dir, attention_backend=backend, **flags))
        assert engine.runner.backend.name == backend
        assert engine.runner.kv_caches[0][0].device.type == DEVICE
        first, _, _ = run_engine(engine, _reqs())
        second, _, _ = run_engine(engine, [hit])  # reads 16 cached tokens of t1 from the pool
        assert engine.scheduler.prefix_hits_total == 16
        results[backend] = (first, second)
    assert results["triton"] == results["torch"]


def test_triton_backend_verifies_speculative_drafts(tiny_model_dir):
    """Drafts verified by the extend kernel (a query of 1 + k rows per request) keep the torch
    backend's greedy tokens; drafts that are wrong at every other position are rejected."""
    flags = dict(page_size=16, max_total_tokens=1024, device=DEVICE, dtype="float32")
    want, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir, attention_backend="torch",
                                                   **flags)), _reqs())

    class Oracle:
        def new_state(self):
            return None

        def propose(self, tokens, k, state=None):
            for r in _reqs():
                seq = r.input_ids + want[r.rid]
                if seq[: len(tokens)] == list(tokens):
                    drafts = seq[len(tokens): len(tokens) + k]
                    return [t if i % 2 == 0 else t + 1 for i, t in enumerate(drafts)]
            return []

    engine = EngineCore(engine_args(tiny_model_dir, attention_backend="triton",
                                    speculative_algorithm="NGRAM", **flags))
    engine.spec.proposer = Oracle()
    got, _, _ = run_engine(engine, _reqs())
    assert got == want
    assert 0 < engine.spec.stats.num_accepted_tokens < engine.spec.stats.num_draft_tokens
