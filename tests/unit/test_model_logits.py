"""Our Llama forward gives transformers' logits (float32) on a tiny model and on SmolLM2."""

from __future__ import annotations

import platform

import pytest
import torch

from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.executor.model_runner import ModelRunner
from services.scheduler.models import quant
from services.scheduler.native import cpu_flags


def our_logits(runner: ModelRunner, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits of every position, computed in chunks through the paged cache."""
    p = runner.page_size
    n = len(ids)
    blocks = list(range(-(-n // p)))[::-1]  # reversed block order: the table must be honoured
    out = []
    chunk = chunk or n
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pos = torch.arange(start, end)
        slots = torch.tensor([blocks[i // p] * p + i % p for i in range(start, end)])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            slot_mapping=slots,
            query_lens_cpu=[end - start],
            seq_lens_cpu=[end],
            page_size=p,
        )
        with torch.inference_mode():
            out.append(runner.model(torch.tensor(ids[start:end]), pos, meta, runner.kv_caches,
                                    torch.arange(end - start)))
    return torch.cat(out)


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("chunk", [None, 7])
def test_tiny_llama_logits_match_transformers(tiny_model_dir, chunk):
    runner = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu", dtype="float32")
    ids = list(range(1000, 1050))
    ours = our_logits(runner, ids, chunk)
    ref = hf_logits(tiny_model_dir, ids)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("tiles", ["1", "0"])
def test_smollm2_logits_match_transformers(smol_path, monkeypatch, tiles):
    """Within twice transformers' own float32 distance from the float64 logits, with the
    projections from our float32 tiles (where this CPU runs them) and from oneDNN. A fixed
    bound is not: on an AVX2 EPYC both are 9e-5 from float64 (logits up to 40), so 1e-4
    between them failed by rounding alone. Twice, not as close: the tiles sum each output's K
    products in one running float32 lane, where MKL's blocked sums round less; on an AMX Xeon
    VM the tiles were 1.14e-4 from float64 (RMS 2.2e-5), oneDNN 8.0e-5, transformers 6.9e-5
    (RMS 1.1e-5), so the earlier 1.5x failed there by rounding alone."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TOKENLINE_FLOAT32_TILES", tiles)
    runner = ModelRunner(smol_path, max_total_tokens=512, device="cpu", dtype="float32")
    ids = [1, 504, 3458, 282, 4649, 314, 2330, 30, 378, 1535, 2476, 3060, 28, 357, 3032, 30]
    ours = our_logits(runner, ids * 3, chunk=20)
    model = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids * 3])).logits[0].double()
        exact = model.double()(torch.tensor([ids * 3])).logits[0]
    their_err = (theirs - exact).abs().max().item()
    our_err = (ours.double() - exact).abs().max().item()
    assert their_err < 1e-3  # float32's rounding over 30 layers, not a broken reference
    assert our_err <= 2 * their_err, (our_err, their_err)


def _missing_bf16_feature() -> str | None:
    """What this CPU lacks for oneDNN's bfloat16 matmuls (torch asks for AVX512 BW, VL and DQ
    on x86), read from the CPU itself rather than from the code under test; None if nothing."""
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        ok = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # no flags to read: torch's word
        return None if ok else f"bfloat16 matmuls on this {platform.machine()} CPU"
    missing = sorted({"avx512bw", "avx512vl", "avx512dq"} - flags)
    return ", ".join(missing) or None


# bfloat16 end to end on CPU needs the decode kernel's AVX512-BF16 path (else: the fallback)
HAS_AVX512_BF16 = _missing_bf16_feature() is None and "avx512_bf16" in cpu_flags()
# where --dtype bfloat16 keeps bfloat16 activations, attention and KV cache: an AVX512-BF16 CPU
# (bfloat16 projections too), and a CPU with no oneDNN bfloat16 at all (AVX2: the projections
# in float32 from the bfloat16 weights); an AVX-512 CPU without BF16 runs only its projections
# in bfloat16
BF16_END_TO_END = HAS_AVX512_BF16 or _missing_bf16_feature() is not None
PROMPT = [1, 504, 3458, 282, 4649, 314, 2330, 30, 378, 1535, 2476, 3060, 28, 357, 3032, 30]
# bfloat16 logits against float32's, as a fraction of the logits' range: SmolLM2 measured 3%
# (1.2 on a range of 40) end to end, 1.3% with bf16 projections alone
BF16_LOGIT_TOLERANCE = 0.05


def assert_bf16_close(ours: torch.Tensor, ref: torch.Tensor, min_agree: float = 0.9) -> None:
    """Within BF16_LOGIT_TOLERANCE of float32's logits (and not float32's own result); the
    argmax agrees wherever float32's top two are further apart than bf16's largest error, and
    at `min_agree` of all positions (a random-weight model's flat logits have near-ties
    everywhere: transformers' own bfloat16 flips them too)."""
    err = (ours - ref).abs().max().item()
    assert 1e-4 < err < BF16_LOGIT_TOLERANCE * ref.abs().max().item(), err
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert agree.float().mean().item() >= min_agree
    top2 = ref.topk(2, dim=-1).values
    assert agree[(top2[:, 0] - top2[:, 1]) > err].all()


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX512-BF16")
def test_bfloat16_on_cpu_is_bfloat16_end_to_end_and_stays_close(smol_path, monkeypatch):
    """--dtype bfloat16 on an AVX512-BF16 CPU: bf16 weights, activations and KV cache (half
    float32's bytes per token), decodes through the kernel's bf16 path; logits within
    BF16_LOGIT_TOLERANCE of transformers' float32, through chunks and decode steps."""
    monkeypatch.delenv("TOKENLINE_ONEDNN", raising=False)
    runner = ModelRunner(smol_path, max_total_tokens=512, device="cpu", dtype="bfloat16")
    assert runner.dtype == runner.linear_dtype == torch.bfloat16
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_caches)
    # the lm_head from our bfloat16 tiles (a few rows) and oneDNN's copy beside them, where this
    # CPU has AVX512-BF16, else oneDNN's alone: both run below (prefill chunks of 20 rows, decodes)
    tiles = quant.bf16_tiles_missing(runner.model.linear_widths()) is None
    assert runner.linear_backend == ("native_bfloat16" if tiles else "onednn")
    lm = runner.model.lm_tiled.onednn if tiles else runner.model.lm_packed
    assert lm.dtype == torch.bfloat16
    if tiles:
        assert runner.model.lm_tiled.tiles.dtype == torch.bfloat16
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.attention_kernel == "native"
    info = runner.info()
    assert info["dtype"] == info["linear_dtype"] == info["kv_cache"]["dtype"] == "bfloat16"
    c = runner.config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    assert runner.kv_bytes_per_token == 2 * c["num_hidden_layers"] * (
        c["num_key_value_heads"] * head_dim * 2)  # 2 bytes a value: float32's half
    ours = our_logits(runner, PROMPT * 2, chunk=20)  # a prefill, an extend, and their cache
    ref = hf_logits(smol_path, PROMPT * 2)
    assert_bf16_close(ours, ref)
    decoded = our_logits(runner, PROMPT * 2, chunk=1)  # every position a decode step
    assert_bf16_close(decoded, ref)


@pytest.mark.skipif(_missing_bf16_feature() is not None,
                    reason=f"this CPU lacks {_missing_bf16_feature()}")
def test_without_avx512_bf16_only_the_projections_run_in_bf16(smol_path, monkeypatch):
    """A CPU whose decode kernel has no AVX512-BF16 path keeps bf16 projections and float32
    everything else, and says so once at start-up."""
    from structlog.testing import capture_logs

    from services.scheduler.attention import torch_backend

    module = torch_backend.cpu_kernels()
    assert module is not None
    monkeypatch.setattr(module, "fast_bf16", lambda: False)
    monkeypatch.delenv("TOKENLINE_ONEDNN", raising=False)
    with capture_logs() as logs:
        runner = ModelRunner(smol_path, max_total_tokens=512, device="cpu", dtype="bfloat16")
    assert runner.linear_dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.kv_caches[0][0].dtype == torch.float32
    lm = runner.model.lm_tiled
    assert (lm.onednn if lm is not None else runner.model.lm_packed).dtype == torch.bfloat16
    assert runner.info()["linear_dtype"] == "bfloat16"
    assert runner.info()["kv_cache"]["dtype"] == "float32"
    why = [e["event"] for e in logs if "AVX512-BF16" in e["event"]]
    assert why == ["this CPU has no AVX512-BF16: --dtype bfloat16 runs the projections in "
                   "bfloat16, activations, attention and the KV cache in float32"]
    ours = our_logits(runner, PROMPT * 2, chunk=20)
    ref = hf_logits(smol_path, PROMPT * 2)
    assert_bf16_close(ours, ref)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                    reason="this torch build has no oneDNN (torch.backends.mkldnn)")
def test_without_onednn_bf16_the_projections_run_float32_from_bf16_weights(smol_path,
                                                                           monkeypatch):
    """An AVX2 CPU (no oneDNN bfloat16): --dtype bfloat16 keeps bfloat16 activations, attention
    and KV cache, and runs the projections through oneDNN float32 from the bfloat16 weights
    (torch's generic bfloat16 matmul is 3-4x slower there); said once at start-up, and the
    logits are bfloat16's, within BF16_LOGIT_TOLERANCE of float32's through chunks and decodes."""
    from structlog.testing import capture_logs

    from services.scheduler.executor import model_runner

    monkeypatch.setattr(model_runner, "_cpu_bf16_linears", lambda device: False)
    monkeypatch.delenv("TOKENLINE_ONEDNN", raising=False)
    with capture_logs() as logs:
        runner = ModelRunner(smol_path, max_total_tokens=512, device="cpu", dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.linear_dtype == torch.float32
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_caches)
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.model.lm_packed.dtype == torch.float32
    info = runner.info()
    assert info["linear_backend"] == "onednn"
    assert (info["dtype"], info["linear_dtype"], info["kv_cache"]["dtype"]) == (
        "bfloat16", "float32", "bfloat16")
    said = [e for e in logs if "no oneDNN bfloat16" in e["event"]]
    assert len(said) == 1 and said[0]["log_level"] == "info"
    assert "projections in float32 from the bfloat16 weights" in said[0]["event"]
    assert not [e for e in logs if e["log_level"] == "warning"]
    ours = our_logits(runner, PROMPT * 2, chunk=20)
    ref = hf_logits(smol_path, PROMPT * 2)
    assert_bf16_close(ours, ref)
    assert_bf16_close(our_logits(runner, PROMPT * 2, chunk=1), ref)  # every position a decode


def test_without_onednn_bfloat16_runs_torch_and_the_log_says_it_is_slow(tiny_model_dir,
                                                                        monkeypatch):
    """TOKENLINE_ONEDNN=0: --dtype bfloat16 stays bfloat16 end to end in torch's generic
    kernels, and one warning at start-up says that float32 runs faster."""
    from structlog.testing import capture_logs

    monkeypatch.setenv("TOKENLINE_ONEDNN", "0")
    with capture_logs() as logs:
        runner = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu",
                             dtype="bfloat16")
    assert runner.dtype == runner.linear_dtype == torch.bfloat16
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.info()["linear_backend"] == "torch"
    slow = [e for e in logs if "generic bfloat16" in e["event"]]
    assert len(slow) == 1 and slow[0]["log_level"] == "warning"
    assert "--dtype float32 is faster" in slow[0]["event"]
    with capture_logs() as logs:
        ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu", dtype="float32")
    assert not [e for e in logs if "generic bfloat16" in e["event"]]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                    reason="this torch build has no oneDNN (torch.backends.mkldnn)")
@pytest.mark.parametrize("tiles", ["1", "0"])
def test_cpu_projections_keep_only_their_packed_copies(tiny_model_dir, monkeypatch, tiles):
    """Packing must not double the memory the projections hold: their plain weights go, for
    our float32 tiles (where this CPU runs them) as for oneDNN's copies."""
    from structlog.testing import capture_logs

    from services.scheduler import native
    from services.scheduler.models import quant
    from services.scheduler.models.layers import Linear

    monkeypatch.delenv("TOKENLINE_ONEDNN", raising=False)
    monkeypatch.setenv("TOKENLINE_FLOAT32_TILES", tiles)
    with capture_logs() as logs:
        runner = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu",
                             dtype="float32")
    use_tiles = quant.float32_tiles_missing(runner.model.linear_widths()) is None
    said = [e["event"] for e in logs if "not from our C++ tiles" in e["event"]]
    if tiles == "0":  # the start-up log says why, and what runs them instead
        assert said == ["float32 projections not from our C++ tiles (TOKENLINE_FLOAT32_TILES=0): "
                        "through oneDNN"]
    else:
        assert bool(said) != use_tiles
    assert use_tiles == (tiles == "1" and native.QUANT.module().float_isa() != "portable")
    assert runner.linear_backend == ("native_float32" if use_tiles else "onednn")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None for m in linears)
    if use_tiles:
        assert all(m.tiled is not None and m.packed is None for m in linears)
        assert runner.model.lm_tiled is not None and runner.model.lm_packed is None
    else:
        assert all(m.packed is not None and m.tiled is None for m in linears)
        assert runner.model.lm_packed is not None and runner.model.lm_tiled is None
    embed = runner.model.embed_tokens.weight
    norms = sum(p.numel() for n, p in runner.model.named_parameters() if "norm" in n)
    assert runner.weight_bytes == (embed.numel() + norms) * 4
    # the copies: every projection's weight, and the tied lm_head's, padded to whole tiles
    # of 16 output channels at most
    plain = sum(m.in_features * m.out_features for m in linears) + embed.numel()
    padding = sum(m.in_features * 15 for m in linears) + embed.shape[1] * 15
    assert plain * 4 <= runner.packed_bytes <= (plain + padding) * 4 + (1 << 16)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert runner.num_parameters == hf.num_parameters()  # still counts every parameter
