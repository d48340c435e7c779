"""--quantization through the engine: the rest of it works the same (continuous batching,
chunked prefill, prefix cache, retraction, sampling), and the accuracy it costs on the real
SmolLM2 stays under stated bounds (bench.quality on the shipped text)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.quality import measure
from common.messages import SamplingParams
from services.scheduler.attention.torch_backend import TorchBackend
from services.scheduler.core.engine import EngineCore
from services.scheduler.models import model_class, quant
from services.scheduler.models.quantize import quantize_model
from tests.helpers import engine_args, run_engine
from tests.integration.test_sampling_engine import _crowd, _seeded
from tokenline import Engine


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_seeded_request_is_identical_alone_in_a_crowd_and_through_retraction(tiny_model_dir,
                                                                            mode):
    alone, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir, quantization=mode)),
                             [_seeded()])
    crowd_engine = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=7,
                                          quantization=mode))
    crowd, _, _ = run_engine(crowd_engine, _crowd() + [_seeded()])
    tight = EngineCore(engine_args(tiny_model_dir, max_total_tokens=480, page_size=8,
                                   schedule_conservativeness=0.0, quantization=mode))
    retracted, _, _ = run_engine(tight, _crowd() + [_seeded()])
    assert tight.scheduler.num_retractions_total > 0
    assert tight.runner.info()["quantization"]["mode"] == mode
    assert len(alone["seeded"]) == 48
    assert crowd["seeded"] == alone["seeded"]
    assert retracted["seeded"] == alone["seeded"]


def test_offline_engine_with_prefix_cache_repeats_itself(tiny_model_dir):
    engine = Engine(model=str(tiny_model_dir), max_total_tokens=4096, quantization="int4")
    prompt = list(range(2000, 2100))
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    assert again.cached_tokens > 0
    assert again.token_ids == first.token_ids


# Bounds on the first 1,024 tokens of the shipped text (two windows of 512; the whole 2,041
# gave the same figures for twice the time), against float32. With our C++ kernels (float32
# in and out) measured on an AVX2 EPYC: int8 KL 0.000035, perplexity 19.7552 against 19.7523,
# top-1 0.997; int4 KL 0 to float32 rounding (1e-9), the same perplexity, top-1 1.0: int4
# runs the file's own Q4_1 and Q8_0 values, which float32 runs dequantized, so only the
# summation order differs. Without a compiler torch's bfloat16 kernels run (measured: int8 KL
# 0.012, perplexity +1.4%; int4 KL 0.0024, +0.4%), with the looser bounds.
BOUNDS = {  # mode -> (max |KL|, max perplexity ratio, min top-1 agreement)
    True: {"int8": (1e-4, 1.001, 0.99), "int4": (1e-6, 1.00001, 0.999)},
    False: {"int8": (0.03, 1.03, 0.9), "int4": (0.01, 1.02, 0.9)},
}


def test_perplexity_and_kl_against_float32_stay_under_bounds():
    base, *quantized = measure(["none", "int8", "int4"], max_tokens=1025)
    assert base.tokens >= 1000 and base.mean_kl == 0
    for q in quantized:
        max_kl, max_ratio, min_top1 = BOUNDS[quant.native()][q.quantization]
        # KL is >= 0; a sum of float32 log-probabilities can land a hair below 0 when the
        # distributions are the same to rounding
        assert -1e-6 <= q.mean_kl <= max_kl, q
        assert q.perplexity <= max_ratio * base.perplexity, q
        assert q.top1_agreement >= min_top1, q


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_dequantize_on_load_gives_the_kernels_numbers(tiny_model_dir, mode):
    """Off CPU (CUDA) the quantized values are dequantized into the plain weights on load,
    with no kernel: the same model as the CPU kernels run, to float32 summation order."""
    config = json.loads((tiny_model_dir / "config.json").read_text())

    def load():
        model = model_class(config)(config, TorchBackend(), 256)
        model.load_weights(tiny_model_dir)
        return model.eval()

    plain, packed = load(), load()
    summary = quantize_model(plain, mode, None, packed=False)
    assert summary.kernel == "dequantized" and summary.at_load > 0
    assert all(m.quantized is None for m in plain.modules() if hasattr(m, "quantized"))
    quantize_model(packed, mode, None, packed=True)
    checked = 0
    for (name, a), b in zip(plain.named_modules(), packed.modules(), strict=True):
        if getattr(b, "quantized", None) is not None:
            x = torch.randn(5, a.in_features)
            torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5, msg=name)
            checked += 1
    assert checked == summary.at_load - 1  # every projection; the lm_head is checked below
    ids = torch.tensor([0, 3, 100])
    torch.testing.assert_close(plain.embed(ids), packed.embed(ids))
    h = torch.randn(2, config["hidden_size"])
    torch.testing.assert_close(plain.logits(h), packed.logits(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_chunked_prompt_runs_steps_without_logits(tiny_model_dir, mode):
    """A prompt longer than the chunk runs steps that sample nothing: the lm_head gets no rows.
    The C++ kernels assume at least one row (an AVX2 build crashed the process on none)."""
    from common.messages import TokenizedReq

    engine = EngineCore(engine_args(tiny_model_dir, quantization=mode, chunked_prefill_size=16))
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    got, _, steps = run_engine(engine, [TokenizedReq(
        rid="long", gateway_id="g", input_ids=list(range(1000, 1050)), params=params)])
    assert len(got["long"]) == 3 and steps == 4 + 2  # 4 prefill chunks, 2 more decodes
