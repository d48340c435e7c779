"""Every family's forward equals transformers' (float32) on a tiny random model of that family:
a batch of mixed-length prompts through chunked prefill, decode steps past the sliding window,
and a request retracted and recomputed mid-way; greedy tokens through the engine (chunked
prefill, retraction) equal transformers' generate."""

from __future__ import annotations

import random

import pytest
import torch

from bench.families import FAMILIES, WINDOW, make_tiny
from common.messages import SamplingParams, TokenizedReq
from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.core.engine import EngineCore
from services.scheduler.executor import model_runner
from services.scheduler.executor.model_runner import ModelRunner
from tests.helpers import engine_args, run_engine
from tests.unit.test_model_logits import BF16_END_TO_END, assert_bf16_close

PAGE = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smol_path):
    path = make_tiny(request.param, tmp_path_factory.mktemp(request.param), smol_path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, path, hf


def run_schedule(runner: ModelRunner, seqs: list[list[int]], prefill: list[int], chunk: int,
                 retract_at: int) -> list[torch.Tensor]:
    """Logits of every position of every sequence, all of them in the same steps: the first
    prefill[b] tokens in chunks of `chunk`, the rest one token a step (decode). At step
    `retract_at`, sequence 0 loses its blocks and recomputes what it had in fresh ones."""
    pool = list(range(runner.num_blocks))
    random.Random(0).shuffle(pool)  # tables point anywhere in the pool
    tables = [[pool.pop() for _ in range(-(-len(s) // PAGE))] for s in seqs]
    done = [0] * len(seqs)
    prefill = list(prefill)
    out = [torch.full((len(s), runner.vocab_size), float("nan")) for s in seqs]
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        rows = [b for b in range(len(seqs)) if done[b] < len(seqs[b])]
        news = [min(chunk, prefill[b] - done[b]) if done[b] < prefill[b] else 1 for b in rows]
        ids, positions, slots = [], [], []
        for b, n in zip(rows, news, strict=True):
            for p in range(done[b], done[b] + n):
                ids.append(seqs[b][p])
                positions.append(p)
                slots.append(tables[b][p // PAGE] * PAGE + p % PAGE)
        width = max(len(tables[b]) for b in rows)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *news]).cumsum(0).int(),
            seq_lens=torch.tensor([done[b] + n for b, n in zip(rows, news, strict=True)]).int(),
            block_tables=torch.tensor([tables[b] + [-1] * (width - len(tables[b]))
                                       for b in rows], dtype=torch.int32),
            slot_mapping=torch.tensor(slots),
            query_lens_cpu=news,
            seq_lens_cpu=[done[b] + n for b, n in zip(rows, news, strict=True)],
            page_size=PAGE,
        )
        with torch.inference_mode():
            logits = runner.model(torch.tensor(ids), torch.tensor(positions), meta,
                                  runner.kv_caches, torch.arange(len(ids)))
        t = 0
        for b, n in zip(rows, news, strict=True):
            out[b][done[b] : done[b] + n] = logits[t : t + n]
            done[b] += n
            t += n
        step += 1
        if step == retract_at:  # retracted: blocks back, resumed by recomputing its tokens
            assert done[0] > WINDOW, "retract past the window, mid-decode"
            tables[0] = [pool.pop() for _ in tables[0]]
            prefill[0], done[0] = done[0], 0
    return out


def test_logits_match_transformers_through_chunks_decode_and_retraction(family):
    name, path, hf = family
    runner = ModelRunner(path, max_total_tokens=1024, page_size=PAGE, device="cpu",
                         dtype="float32")
    assert runner.architecture == FAMILIES[name][1]
    rng = random.Random(1)
    lengths = [13, 40, 7, 29]  # total tokens per sequence
    prefill = [9, 22, 3, 29]  # of which prompt; the rest are decode steps (past the window)
    seqs = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    ours = run_schedule(runner, seqs, prefill, chunk=5, retract_at=8)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        err = (ours[b] - ref).abs().max().item()
        assert err < 1e-4, f"{name}: sequence {b} differs by {err}"


def test_greedy_tokens_equal_transformers_generate(family):
    name, path, hf = family
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 11, 26, 3, 20)]
    new = 20
    reference = []
    for ids in prompts:
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                          max_new_tokens=new, do_sample=False)
        out = gen[0, len(ids):].tolist()
        reference.append(out[: out.index(2) + 1] if 2 in out else out)
    # a small pool (no room for all six at once) and short chunks: retractions happen
    engine = EngineCore(engine_args(path, max_total_tokens=96, page_size=PAGE,
                                    chunked_prefill_size=5, max_prefill_tokens=9,
                                    schedule_conservativeness=0.0, disable_prefix_cache=True,
                                    debug_check_integrity=True))
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    reqs = [TokenizedReq(rid=str(i), gateway_id="g", input_ids=ids, params=params)
            for i, ids in enumerate(prompts)]
    tokens, _, _ = run_engine(engine, reqs)
    assert engine.scheduler.num_retractions_total > 0
    for i, ref in enumerate(reference):
        assert tokens[str(i)] == ref, f"{name}: prompt {i} differs from transformers"
    engine.check_integrity()


@pytest.mark.skipif(not BF16_END_TO_END, reason=(
    "this CPU runs only the projections in bfloat16 (AVX-512 without BF16)"))
def test_bfloat16_end_to_end_stays_close_for_every_family(family):
    """--dtype bfloat16 (bf16 weights, activations, KV cache and decode kernel; on a CPU with no
    oneDNN bfloat16 the projections run float32 from the bf16 weights) runs every family through
    chunked prefill and decode steps past the sliding window, within BF16_LOGIT_TOLERANCE of
    transformers' float32."""
    name, path, hf = family
    runner = ModelRunner(path, max_total_tokens=256, page_size=PAGE, device="cpu",
                         dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    bf16_linears = model_runner._cpu_bf16_linears(torch.device("cpu"))
    assert runner.linear_dtype == (torch.bfloat16 if bf16_linears else torch.float32)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.attention_kernel == "native"
    seqs = [[random.Random(3 + b).randrange(100, 40000) for _ in range(n)] for b, n in
            enumerate((30, 12))]
    ours = run_schedule(runner, seqs, [20, 5], chunk=7, retract_at=-1)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        assert_bf16_close(ours[b], ref, min_agree=0.0)
