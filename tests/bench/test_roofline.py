"""The roofline's arithmetic, checked by hand on a tiny model, and its measurement."""

from __future__ import annotations

import json

import pytest

from bench import roofline
from bench.roofline import (
    ModelShape,
    decode_step_bound,
    decode_step_bytes,
    decode_step_flops,
    layer_matmul_params,
    lm_head_params,
    measure_machine,
    norm_params,
)

# hidden 4, 2 layers, 2 heads of dim 2 sharing 1 KV head, MLP 8, vocab 10.
TINY = ModelShape(hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
                  intermediate_size=8, vocab_size=10, tie_word_embeddings=True)


def test_tiny_model_flops_and_bytes_by_hand() -> None:
    # Per layer: q 4x4=16, k 4x2=8, v 8, o 16 -> 48; gate, up, down 3x4x8=96 -> 144; x2 layers.
    assert layer_matmul_params(TINY) == 288
    assert lm_head_params(TINY) == 40
    assert norm_params(TINY) == 20  # (2 per layer + final) x hidden
    batch, context = 3, 5
    # 2 x (288 + 40) x 3 = 1968, plus attention 4 x 2 layers x 2 heads x 2 dim x 5 x 3 = 480.
    assert decode_step_flops(TINY, batch, context) == 2448
    # fp32 weights 4 x (288 + 40 + 20) = 1392, plus K and V 2 x 2 x 1 x 2 x 5 x 3 x 4 = 480.
    assert decode_step_bytes(TINY, batch, context) == 1872


def test_bound_is_the_slower_of_compute_and_memory() -> None:
    assert decode_step_bound(TINY, 3, 5, flops_per_s=1000, bytes_per_s=1000) == pytest.approx(
        2.448)
    assert decode_step_bound(TINY, 3, 5, flops_per_s=1000, bytes_per_s=100) == pytest.approx(
        18.72)
    rows = roofline.roofline_table(TINY, [3], 5, 1000, 100)
    assert rows[0]["bound_by"] == "memory" and rows[0]["tokens_per_s"] == pytest.approx(3 / 18.72)


def test_default_shape_is_smollm2_135m() -> None:
    shape = ModelShape()
    total = layer_matmul_params(shape) + lm_head_params(shape) + norm_params(shape)
    assert total == 134_515_008  # SmolLM2-135M's parameter count (embedding tied to lm_head)
    config = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
              "tie_word_embeddings": True}
    assert ModelShape.from_config(config) == shape  # head_dim derived as 576 / 9


def test_measure_machine_is_positive() -> None:
    flops, bandwidth = measure_machine(matmul_size=128, bandwidth_mib=4, repeats=2, threads=1)
    assert flops > 1e6 and bandwidth > 1e6


def test_cli_prints_table_and_writes_json(tmp_path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": 8, "vocab_size": 10,
        "tie_word_embeddings": True}))
    out = tmp_path / "r.json"
    rc = roofline.main(["--config", str(config), "--context", "5", "--batches", "1,3",
                        "--flops", "1e-6", "--bandwidth", "1e-6", "--json", str(out)])
    assert rc == 0
    assert "bound by" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["rows"]] == [1, 3]
    assert doc["rows"][1]["flops"] == 2448 and doc["rows"][1]["bytes"] == 1872
    assert doc["rows"][1]["bound_ms"] == pytest.approx(2.448 * 1e3)
