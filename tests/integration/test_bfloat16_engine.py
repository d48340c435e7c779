"""--dtype bfloat16 end to end on real SmolLM2: greedy tokens equal float32's on the test prompts
(up to float32's own near-ties), and the KV pool holds twice the tokens for the same bytes, as the
start-up log, the server info and the planner's check all say."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from bench.plan import check_server
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args, run_engine
from tests.integration.test_greedy_equivalence import PROMPTS, _reqs
from tests.unit.test_model_logits import BF16_END_TO_END, BF16_LOGIT_TOLERANCE, our_logits

pytestmark = pytest.mark.skipif(not BF16_END_TO_END, reason=(
    "this CPU runs only the projections in bfloat16 (AVX-512 without BF16)"))

# float32's top two logits closer than this (SmolLM2's logits span about 40) are a near-tie
# that bfloat16's rounding may break the other way: measured, 3 of the 8 prompts give float32's
# 32 tokens exactly and the other 5 part at gaps of 0.005 to 0.10, while bf16 moves single logits
# by up to 1.7. A gap up to bfloat16's own largest logit error at that position is a near-tie
# too: on a Zen 4 EPYC one prompt parted at a gap of 0.205 where bf16's logits there were up to
# 0.272 off float32's (the other five at 0.005-0.052, errors 0.22-0.54).
NEAR_TIE = 0.15
BUDGET_GIB = 2.0  # small, so that two pools fit on a shared test machine


@pytest.fixture(scope="module")
def prompt_ids(smol_path):
    tok = Tokenizer.from_file(str(smol_path / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def start(smol_path, dtype: str):
    """An engine sized by the memory budget (not a token count), and its start-up log."""
    with capture_logs() as logs:
        engine = EngineCore(engine_args(smol_path, dtype=dtype, max_total_tokens=None,
                                        cpu_memory_gib=BUDGET_GIB))
    return engine, logs


@pytest.fixture(scope="module")
def engines(smol_path):
    return {dtype: start(smol_path, dtype) for dtype in ("float32", "bfloat16")}


def test_bf16_pool_holds_twice_the_tokens_and_says_so(engines):
    (f32, _), (bf16, logs) = engines["float32"], engines["bfloat16"]
    runner = bf16.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert 2 * runner.kv_bytes_per_token == f32.runner.kv_bytes_per_token
    tokens = runner.num_blocks * runner.page_size
    # the same budget, half the bytes a token (and half the weights' bytes): over twice as many
    assert tokens >= 2 * f32.runner.num_blocks * f32.runner.page_size
    line = next(e for e in logs if e["event"].startswith("KV cache:"))
    assert line["event"].startswith(f"KV cache: {tokens} tokens in {runner.num_blocks} blocks")
    assert f"{runner.kv_bytes / (1 << 30):.2f} GiB" in line["event"]
    assert line["dtype"] == "torch.bfloat16" and line["decode_attention"] == "native"
    kv = runner.info()["kv_cache"]  # what /get_server_info reports
    assert kv["dtype"] == "bfloat16" and kv["num_tokens"] == tokens
    assert kv["bytes"] == tokens * runner.kv_bytes_per_token
    check = check_server(runner.info(), None)  # the planner predicts the same bytes per token
    assert check.matches and check.server_num_tokens == tokens


def test_bf16_greedy_tokens_equal_float32_up_to_near_ties(engines, prompt_ids):
    (f32, _), (bf16, _) = engines["float32"], engines["bfloat16"]
    want, _, _ = run_engine(f32, _reqs(prompt_ids))
    got, _, _ = run_engine(bf16, _reqs(prompt_ids))
    for i, ids in enumerate(prompt_ids):
        a, b = want[str(i)], got[str(i)]
        if a == b:
            continue
        n = next(j for j in range(min(len(a), len(b)) + 1) if j == len(a) or a[j] != b[j])
        logits = our_logits(f32.runner, ids + a[:n])[-1]  # float32's, where they part
        top2 = logits.topk(2).values
        gap = (top2[0] - top2[1]).item()
        # bfloat16's rounding of this position's logits, within the tolerance held elsewhere
        err = (our_logits(bf16.runner, ids + a[:n])[-1].float() - logits).abs().max().item()
        assert err < BF16_LOGIT_TOLERANCE * (logits.max() - logits.min()).item()
        assert gap < max(NEAR_TIE, err), (
            f"prompt {i}: bf16 left float32's tokens at {n}, gap {gap:.3f} (bf16 error {err:.3f})")
        print(f"prompt {i}: bf16 parts from float32 at token {n}, a near-tie (gap {gap:.3f}, "
              f"bf16 error there {err:.3f})")
    bf16.check_integrity()
    f32.check_integrity()
