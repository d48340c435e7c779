"""The long-context and shared-document workloads of `bench peers` (bench/long_workloads.py),
the ratio table its `--suite` ends with, and the flags that pick them: no server, no model."""

from __future__ import annotations

import os

import pytest

from bench import peers
from bench.long_workloads import (
    CONTEXT,
    SUITES,
    TOKEN_HIGH,
    TOKEN_LOW,
    WORKLOADS,
    cold_warmup,
    multiturn_long,
    shared_doc,
    suite_workloads,
)
from bench.peers import Run
from bench.peers_suite import context_limits, format_suite_table, load_workloads, too_long

PAGE = 16  # tokens per KV block, our default: a shared first block would be a shared prefix
KV_POOL_FLOAT32 = 69_000  # our default pool for SmolLM2-135M in float32, about


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_workload_is_the_same_for_a_seed_and_another_for_another(name) -> None:
    make = WORKLOADS[name]
    first, again, other = make(0), make(0), make(1)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert [r.max_tokens for r in first] == [r.max_tokens for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_request_fits_smollm2s_context_with_ordinary_tokens(name) -> None:
    for r in WORKLOADS[name](0):
        assert r.prompt_len == len(r.prompt)
        assert r.prompt_len + r.max_tokens <= CONTEXT
        assert TOKEN_LOW <= min(r.prompt) and max(r.prompt) < TOKEN_HIGH


@pytest.mark.parametrize(("name", "count", "low", "high"), [
    ("long-2k", 16, 1950, 2050), ("long-4k", 16, 3900, 4100), ("long-7k", 8, 6900, 7100),
    ("long-mixed", 16, 2500, 4500)])
def test_long_prompts_are_in_range_and_share_no_first_block(name, count, low, high) -> None:
    requests = WORKLOADS[name](0)
    assert len(requests) == count
    assert all(low <= r.prompt_len <= high and r.max_tokens == 128 for r in requests)
    assert len({tuple(r.prompt[:1]) for r in requests}) == count  # distinct from token one
    assert len({tuple(r.prompt[:PAGE]) for r in requests}) == count


def test_long_4k_and_7k_fit_our_default_float32_kv_pool_all_at_once() -> None:
    for name in ("long-4k", "long-7k"):
        assert sum(r.prompt_len + r.max_tokens for r in WORKLOADS[name](0)) < KV_POOL_FLOAT32


def test_shared_doc_requests_share_exactly_the_document() -> None:
    requests = shared_doc(0)
    assert len(requests) == 32 and all(r.max_tokens == 64 for r in requests)
    assert all(3000 + 20 <= r.prompt_len <= 3000 + 60 for r in requests)
    for i, a in enumerate(requests):
        for b in requests[i + 1:]:
            assert _common_prefix(a.prompt, b.prompt) == 3000


def test_multiturn_long_re_sends_each_chats_history_behind_one_system_prompt() -> None:
    requests = multiturn_long(0)
    chats = [[r for r in requests if r.conversation == c] for c in range(8)]
    assert all(len(turns) == 6 for turns in chats) and len(requests) == 48
    for turns in chats:
        for before, after in zip(turns, turns[1:], strict=False):
            # the previous prompt, its 128-token answer, then a 100-300-token user message
            assert after.prompt[:before.prompt_len] == before.prompt
            assert 128 + 100 <= after.prompt_len - before.prompt_len <= 128 + 300
    firsts = [turns[0].prompt for turns in chats]
    assert all(_common_prefix(firsts[0], p) == 2048 for p in firsts[1:])
    assert max(r.prompt_len for r in requests) <= 2048 + 6 * 300 + 5 * 128


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_warm_up_shares_no_kv_block_with_the_workload(name) -> None:
    """Else shared-doc's document would be cached before the burst that should compute it."""
    [(_, requests, warmup)] = load_workloads(name, None, 0, None)
    assert warmup == cold_warmup(requests)
    assert warmup.prompt_len == len(warmup.prompt) == requests[0].prompt_len
    assert all(_common_prefix(warmup.prompt, r.prompt) < PAGE for r in requests)


def test_a_suite_is_a_name_or_a_list_of_workloads() -> None:
    assert suite_workloads("long") == SUITES["long"] == list(WORKLOADS)
    assert suite_workloads("shared-doc, long-4k") == ["shared-doc", "long-4k"]
    with pytest.raises(ValueError, match="long-9k"):
        suite_workloads("shared-doc,long-9k")


def test_the_cli_takes_a_workload_name_or_a_suite() -> None:
    args = peers.build_parser().parse_args(["--peer", "none", "--workload", "shared-doc",
                                            "--num-prompts", "4", "--seed", "3"])
    [(label, requests, _)] = load_workloads(args.workload, args.suite, args.seed,
                                            args.num_prompts)
    assert label == "shared-doc (seed 3)" and len(requests) == 4
    assert [r.prompt for r in requests] == [r.prompt for r in shared_doc(3)[:4]]
    args = peers.build_parser().parse_args(["--suite", "long", "--rounds", "3"])
    loaded = load_workloads(args.workload, args.suite, args.seed, args.num_prompts)
    assert [w.label.split()[0] for w in loaded] == list(WORKLOADS)
    [(label, _, warmup)] = load_workloads(None, None, 0, 2)  # neither: the fixed mixed64.jsonl
    assert label == "mixed64.jsonl" and warmup is None  # its first request warms up, as ever


def test_suite_and_workload_together_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.main(["--peer", "none", "--suite", "long", "--workload", "shared-doc"])
    assert exc.value.code == 2
    assert "--suite or --workload" in capsys.readouterr().err


def test_requests_longer_than_a_servers_context_are_named_before_any_start() -> None:
    args = peers.build_parser().parse_args(["--peer", "vllm", "--vllm-max-model-len", "4096",
                                            "--suite", "long", "--", "--max-model-len", "8192"])
    assert context_limits(args) == {"vllm --max-model-len": 4096,
                                    "tokenline serve --max-model-len": 8192}
    workloads = load_workloads(None, args.suite, 0, None)
    problems = too_long(workloads, context_limits(args))
    assert [p.split()[0] for p in problems] == ["long-4k", "long-7k", "long-mixed",
                                                "multiturn-long"]
    assert all("exceeds vllm --max-model-len 4096" in p for p in problems)


def _run(system: str, seconds: float, ttft_ms: float, round_: int) -> Run:
    return Run(system, seconds, 1000, 0, ttft_ms, 50.0, {"round": round_})


def test_the_suite_table_pairs_rounds_and_gives_ttft_ranges() -> None:
    ours, vllm = "tokenline serve", "vllm serve (float32)"
    runs = [_run(vllm, 10.0, 9500, 1), _run(ours, 8.0, 13600, 1),  # rounds out of order
            _run(ours, 10.0, 13700, 0), _run(vllm, 8.0, 9900, 0)]
    only_ours = [_run(ours, 4.0, 1000, 0)]
    text = format_suite_table([("shared-doc (seed 0)", runs), ("long-4k (seed 0)", only_ours)],
                              "bfloat16", ours)
    head, rule, row, lonely = text.splitlines()
    assert head.startswith("| workload | dtype | peer | peer tok/s (rounds) | ours tok/s")
    assert rule.count("|") == head.count("|")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["shared-doc (seed 0)", "bfloat16", vllm, "125.0, 100.0", "100.0, 125.0",
                     "0.80x, 1.25x", "9.5-9.9 s / 13.6-13.7 s"]
    cells = [c.strip() for c in lonely.strip("|").split("|")]
    assert cells == ["long-4k (seed 0)", "bfloat16", "-", "-", "250.0", "-", "- / 1.0 s"]


def test_the_suite_json_keeps_each_workloads_runs(tmp_path, monkeypatch) -> None:
    """--json with --suite: a list of workloads, each with its header and runs, and the table."""
    import json

    ours = "tokenline serve"
    results = [("a", "header a", [_run(ours, 1.0, 10, 0)]),
               ("b", "header b", [_run(ours, 2.0, 10, 0)])]
    args = peers.build_parser().parse_args(["--suite", "long", "--json",
                                            os.fspath(tmp_path / "out.json")])
    peers._suite_report(args, results)
    out = json.loads((tmp_path / "out.json").read_text())
    assert [w["workload"] for w in out["workloads"]] == ["a", "b"]
    assert out["workloads"][1]["runs"][0]["tokens_per_s"] == 500.0
    assert out["table"].count("\n") == 3
