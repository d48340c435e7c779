"""The memory planner reproduces the Llama-3-8B on an 80 GB H100 figures."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from bench.plan import GPUS, PRESETS, GiB, KiB, count_params, load_shape, main, plan

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama_3_8b_on_h100() -> None:
    res = plan(PRESETS["llama-3-8b"], GPUS["h100-80gb"], 0.92, 6.0)
    assert f"{res.weight_bytes / GiB:.2f}" == "14.96"
    assert res.kv_bytes_per_token == 128 * KiB
    assert f"{res.kv_pool_bytes / GiB:.1f}" == "52.3"
    assert round(res.token_capacity, -3) == 429_000
    assert res.max_sequences == 52
    assert res.max_model_len == 8192
    assert round(res.train_bytes / 1e9) == 128
    assert res.batch == 52
    assert round(res.arithmetic_intensity) == 52
    assert round(res.ridge_point) == 295
    assert res.memory_bound


def test_counting_kv_reads_lowers_the_decode_intensity() -> None:
    weights_only = plan(PRESETS["llama-3-8b"], GPUS["h100-80gb"])
    with_kv = plan(PRESETS["llama-3-8b"], GPUS["h100-80gb"], include_kv_bytes=True)
    assert with_kv.arithmetic_intensity < weights_only.arithmetic_intensity


def test_quantized_weights_take_their_bytes_and_free_pool_room() -> None:
    model = PRESETS["llama-3-8b"]
    none = plan(model, GPUS["h100-80gb"])
    int8 = plan(model, GPUS["h100-80gb"], quantization="int8")
    int4 = plan(model, GPUS["h100-80gb"], quantization="int4")
    assert int8.weight_bytes == pytest.approx(model.params * 1.125)
    assert int4.weight_bytes == pytest.approx(model.params * 0.625)
    assert int4.kv_pool_bytes - none.kv_pool_bytes == pytest.approx(
        none.weight_bytes - int4.weight_bytes)
    assert int4.kv_bytes_per_token == none.kv_bytes_per_token  # the KV cache is not quantized
    assert int4.max_sequences > int8.max_sequences > none.max_sequences


def test_h200_fits_twice_the_sequences() -> None:
    res = plan(PRESETS["llama-3-8b"], GPUS["h200"])
    assert res.max_sequences == 107
    assert round(res.ridge_point) == 206


def test_params_counted_from_a_transformers_config() -> None:
    assert f"{count_params(LLAMA_3_8B_CONFIG) / 1e9:.2f}" == "8.03"


def test_config_json_gives_the_same_plan_as_the_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    shape = load_shape(str(tmp_path))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.max_model_len) == (32, 8, 128, 8192)
    res = plan(shape, GPUS["h100-80gb"])
    assert res.max_sequences == 52
    assert f"{res.kv_pool_bytes / GiB:.1f}" == "52.3"


def test_gguf_metadata_gives_the_shape(tmp_path: Path) -> None:
    import gguf  # a dependency: its absence is a broken install, not a skip
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(512)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = load_shape(str(path))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.max_model_len) == (2, 2, 16, 512)
    assert shape.params == 100 * 64 + 64


def test_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "llama-3-8b", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    for text in ("weights             14.96 GiB", "KV per token        128 KiB",
                 "KV pool             52.3 GiB", "(~429k)", "52 sequences at 8,192 tokens",
                 "training memory     128 GB", "52.0 FLOP/byte at batch 52",
                 "ridge point         295 FLOP/byte (memory-bound)"):
        assert text in out


def test_cli_shape_flags_and_explicit_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "8.03e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
            "--hidden", "4096", "--gpu-memory-gib", "79.65", "--gpu-memory-utilization", "0.92",
            "--overhead-gib", "6", "--dtype", "bf16", "--max-model-len", "8192",
            "--peak-tflops", "989", "--bandwidth-tbs", "3.35", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)["plan"]
    assert res["max_sequences"] == 52
    assert res["kv_bytes_per_token"] == 131072


def server_info() -> dict:
    # A float32 pool of SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 x 4 bytes per token.
    per_token = 2 * 30 * 3 * 64 * 4
    return {
        "model": "SmolLM2-135M-Instruct",
        "max_model_len": 8192,
        "kv_cache": {"num_tokens": 4096, "num_blocks": 256, "page_size": 16,
                     "bytes": 4096 * per_token, "dtype": "float32"},
        "model_config": {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
                         "hidden_size": 576, "num_parameters": 134515008},
    }


async def run_against_server(argv: list[str]) -> int:
    """Run `tokenline plan` against a tiny aiohttp server that answers /get_server_info."""

    async def handler(_: web.Request) -> web.Response:
        return web.json_response(server_info())

    app = web.Application()
    app.router.add_get("/get_server_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        # main() blocks on urllib; the server needs this loop free meanwhile.
        return await asyncio.to_thread(main, [*argv, "--url", f"http://127.0.0.1:{port}"])
    finally:
        await runner.cleanup()


async def test_plan_url_compares_with_the_server_pool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await run_against_server([]) == 0
    out = capsys.readouterr().out
    assert "predicted 46,080 B, server 46,080.0 B (matches)" in out
    assert "implied capacity    4,096 tokens" in out


async def test_plan_url_flags_a_model_that_does_not_match_the_pool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await run_against_server(["--preset", "llama-3-8b"]) == 0
    out = capsys.readouterr().out
    assert "52 sequences at 8,192 tokens" in out
    assert "predicted 262,144 B, server 46,080.0 B (off by 0.176x)" in out


def test_plan_url_unreachable_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().out
