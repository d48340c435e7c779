"""`tokenline bench profile` on a tiny random Llama: each step's split adds up, the op counts
are the model's, and a bad --steps is refused before anything loads."""

from __future__ import annotations

import pytest

from bench import step_profile as profile
from services.scheduler.executor.model_runner import ModelRunner


def test_each_step_splits_into_its_parts(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32",
                         max_total_tokens=64 * 400 + 2048 + 64)
    steps = profile.profile_steps(runner, list(profile.STEPS), repeats=2, flops_per_s=1e11,
                                  bytes_per_s=1e10)
    assert [p.step for p in steps] == ["decode64", "prefill", "decode1"]
    for p in steps:
        assert set(p.ms) == set(profile.CATEGORIES)
        assert sum(p.ms.values()) == pytest.approx(p.timed_ms, rel=1e-3, abs=1e-2)
        assert p.ms["matmuls"] > 0 and p.ms["attention"] > 0 and p.ms["sampling"] > 0
        # every projection (qkv, o, gate_up, down) of every layer, and the lm_head: once each
        assert p.ops_by_category["matmuls"] == 4 * runner.num_layers + 1
        assert p.ops == sum(p.ops_by_category.values()) and p.allocs > 0
        assert p.matmul_bound_ms > 0
    text = profile.format_profiles(steps)
    assert "decode64" in text and "costliest ops" in text


def test_unknown_step_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        profile.main(["--steps", "decode1,decode2"])
    assert exc.value.code == 2
    assert "--steps: unknown step 'decode2'" in capsys.readouterr().err


def test_compare_torch_ops_times_both_paths(tiny_model_dir):
    from services.scheduler.native import ops

    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32", max_total_tokens=512)
    built = ops._ops_module
    got = profile.compare_torch_ops(runner, ["decode1"], repeats=2)
    assert ops._ops_module is built  # switched back
    c = got["decode1"]
    assert c["fused_ms"] > 0 and c["torch_ms"] > 0
    assert c["speedup"] == pytest.approx(c["torch_ms"] / c["fused_ms"], rel=1e-2)
