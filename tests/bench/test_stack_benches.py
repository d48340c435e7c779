"""`bench.scale_out` and `bench.routing` on their shared `service_stack` (one process per
service on a local nats-server), with the tiny random model and a few requests."""

from __future__ import annotations

import json

import pytest

from bench import routing, scale_out

pytestmark = pytest.mark.stack  # starts services as processes (make test-fast skips it)


def _stack_flags(model, tmp_path, name: str) -> list[str]:
    return ["--threads", "2", "--kv-tokens", "16384", "--server-flag=--model",
            f"--server-flag={model}", "--result-json", str(tmp_path / name)]


def test_scale_out_runs_one_and_two_schedulers(tiny_model_dir, tmp_path):
    assert scale_out.main(["--num-prompts", "2",
                           *_stack_flags(tiny_model_dir, tmp_path, "scale.json")]) == 0
    rows = json.loads((tmp_path / "scale.json").read_text())
    assert [r["config"] for r in rows] == ["1 scheduler x 2 threads",
                                           "2 schedulers x 1 thread"]
    assert all((r["completed"], r["failed"]) == (2, 0) for r in rows)


def test_routing_one_scheduler_finds_every_later_turns_history(tiny_model_dir, tmp_path):
    assert routing.main(["--conversations", "1", "--configs", "one",
                         *_stack_flags(tiny_model_dir, tmp_path, "routing.json")]) == 0
    [row] = json.loads((tmp_path / "routing.json").read_text())
    assert (row["config"], row["completed"], row["failed"]) == ("1 scheduler", 6, 0)
    # each of the 5 later turns re-sends a history that starts with the 1,024-token system
    # prompt, cached by the turn before it
    assert row["total_cached_tokens"] >= 5 * 1024
