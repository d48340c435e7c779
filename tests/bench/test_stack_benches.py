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


def test_nats_hops_measures_every_hop_on_one_node_and_across_a_clusters_route(tmp_path):
    from bench import nats_cluster

    out = tmp_path / "hops.json"
    assert nats_cluster.main(["--hops", "--messages", "200", "--rounds", "1",
                              "--result-json", str(out)]) == 0
    rows = json.loads(out.read_text())["hops"]
    hops = ["gateway -> tokenizer", "tokenizer -> scheduler", "scheduler -> detokenizer",
            "detokenizer -> gateway"]
    for config in ("1 NATS node", "3-node NATS cluster"):
        mine = [r for r in rows if r["config"] == config]
        assert [r["hop"] for r in mine] == hops
        # acknowledged hops send a quarter as many; every one arrived, at a measured rate
        assert [r["delivered"] for r in mine] == [50, 50, 200, 200]
        assert all(r["lost"] == 0 and r["msgs_per_s"] > 0 for r in mine)
    # a step's 64 outputs and a 300-token prompt are the size the services send
    assert all(r["bytes"] > 1000 for r in rows)


def test_lora_bench_runs_base_and_adapters_on_one_server(tiny_model_dir, tmp_path):
    from bench import lora

    out = tmp_path / "lora.json"
    assert lora.main(["--model", str(tiny_model_dir), "--adapters", "2", "--rank", "4",
                      "--num-prompts", "4", "--single", "1", "--rounds", "1",
                      "--server-flag=--max-total-tokens", "--server-flag=16384",
                      "--result-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["config"] for r in data["rows"]} == {
        "base", "2 adapters", "1 at a time, base", "1 at a time, adapter0"}
    assert all(r["output_throughput"] > 0 for r in data["rows"])
    assert set(data["ratios"]) == {"throughput, adapters / base",
                                   "1 request TPOT p50, adapter / base"}


def test_requests_spread_over_adapters_name_each_in_turn():
    from bench.datasets import SampleRequest
    from bench.lora import spread

    reqs = [SampleRequest([1, 2], 2, 4) for _ in range(5)]
    assert [r.model for r in spread(reqs, ["a", None, "b"])] == ["a", None, "b", "a", None]
    assert all(r.model is None for r in reqs)  # copies: the workload itself is untouched


def test_routing_sends_a_generated_burst_to_one_of_two_schedulers_share(tiny_model_dir, tmp_path):
    """--workload shared-doc through the `one_of_two` config: one scheduler on half the
    threads and KV pool computes the 3,000-token document once for all 32 questions."""
    assert routing.main(["--workload", "shared-doc", "--configs", "one_of_two",
                         *_stack_flags(tiny_model_dir, tmp_path, "burst.json")]) == 0
    [row] = json.loads((tmp_path / "burst.json").read_text())
    assert (row["config"], row["completed"], row["failed"]) == ("1 of 2 schedulers, all", 32, 0)
    # 32 x (3,000 + 20-60) prompt tokens; computed: the document once, then each question
    # and the partial block of the document before it (2,992 of its tokens in full blocks)
    assert row["total_input_tokens"] >= 32 * 3020
    assert row["recomputed_tokens"] <= 3000 + 32 * (60 + 16)
