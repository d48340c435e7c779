"""The batching simulator reproduces the textbook static-vs-continuous figures."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.simulate import TEXTBOOK_LENGTHS, main, simulate

LENGTHS = [8, 4, 3, 10, 2, 5, 7, 1]


def test_static_batching_figures() -> None:
    res = simulate("static", 4, LENGTHS)
    assert res.makespan == 17
    assert res.slot_steps == 68  # 4 x 10 + 4 x 7
    assert res.useful_tokens == 40
    assert res.wasted_slot_steps == 28
    assert f"{res.wasted_fraction:.1%}" == "41.2%"
    assert f"{res.tokens_per_step:.3f}" == "2.353"
    assert res.finish_steps == [10, 10, 10, 10, 17, 17, 17, 17]
    assert f"{res.raw_occupancy:.1%}" == "100.0%"
    assert f"{res.slot_efficiency:.1%}" == "58.8%"


def test_continuous_batching_refills_a_freed_slot_next_step() -> None:
    res = simulate("continuous", 4, LENGTHS)
    assert res.makespan == 12
    assert res.slot_steps == 40
    assert res.wasted_slot_steps == 0
    assert f"{res.tokens_per_step:.3f}" == "3.333"
    # r2 at 3, r1 at 4, r4 at 5, r0 at 8, r5 at 9, r7 at 9, r3 at 10, r6 at 12
    assert res.finish_steps == [8, 4, 3, 10, 5, 9, 12, 9]
    assert f"{res.raw_occupancy:.1%}" == "83.3%"
    assert f"{res.slot_efficiency:.1%}" == "100.0%"


def test_dynamic_with_everyone_at_step_zero_behaves_like_static() -> None:
    dynamic = simulate("dynamic", 4, LENGTHS, batch_wait_steps=3)
    static = simulate("static", 4, LENGTHS)
    assert dynamic.finish_steps == static.finish_steps
    assert dynamic.slot_steps == static.slot_steps


def test_dynamic_starts_a_partial_batch_after_the_wait() -> None:
    arrivals = [0, 0, 0, 6]
    dynamic = simulate("dynamic", 4, [2, 2, 2, 2], arrivals=arrivals, batch_wait_steps=2)
    static = simulate("static", 4, [2, 2, 2, 2], arrivals=arrivals)
    # Dynamic runs r0-r2 in steps 3-4 (waited 2 steps); static waits for r3 to fill the batch.
    assert dynamic.finish_steps == [4, 4, 4, 8]
    assert static.finish_steps == [8, 8, 8, 8]


def test_static_batch_pads_prompts_to_the_longest() -> None:
    res = simulate("static", 4, [1, 1, 1, 1], prompt_lengths=[12, 200, 30, 45])
    assert res.prefill_slots == 800
    assert res.prompt_tokens == 287
    assert f"{res.prefill_padding_fraction:.1%}" == "64.1%"
    packed = simulate("continuous", 4, [1, 1, 1, 1], prompt_lengths=[12, 200, 30, 45])
    assert packed.prefill_slots == packed.prompt_tokens == 287


def test_kv_limit_retracts_yet_every_request_gets_its_full_length() -> None:
    prompts = [10] * len(LENGTHS)
    res = simulate("continuous", 4, LENGTHS, prompt_lengths=prompts, kv_tokens=60)
    assert res.retractions > 0
    assert res.generated == LENGTHS
    assert res.useful_tokens == sum(LENGTHS)
    assert res.recomputed_tokens > 0
    assert res.makespan > simulate("continuous", 4, LENGTHS).makespan


def test_retraction_picks_the_request_with_fewest_generated_tokens() -> None:
    # r0 and r1 start together; r2 takes r1's slot at step 3. Step 5 would need 9 + 9 KV tokens
    # of 16, so r2 (2 generated, against r0's 4) goes back and recomputes after r0 is done.
    res = simulate("continuous", 2, [6, 2, 3], prompt_lengths=[4, 4, 6], kv_tokens=16)
    assert res.retractions == 1
    assert res.recomputed_tokens == 2
    assert res.generated == [6, 2, 3]
    assert res.finish_steps == [6, 2, 7]


def test_request_too_big_for_the_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_tokens"):
        simulate("continuous", 4, [10], prompt_lengths=[100], kv_tokens=50)


@settings(max_examples=200, deadline=None, derandomize=True)  # a fixed seed
@given(
    policy=st.sampled_from(["static", "dynamic", "continuous"]),
    max_batch=st.integers(1, 5),
    reqs=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20), st.integers(0, 15)),
                  min_size=1, max_size=10),
    slack=st.integers(0, 40),
    wait=st.integers(0, 4),
)
def test_every_request_finishes_and_books_balance(
    policy: str, max_batch: int, reqs: list[tuple[int, int, int]], slack: int, wait: int
) -> None:
    lengths, prompts, arrivals = (list(x) for x in zip(*reqs, strict=True))
    kv = max(p + n for n, p, _ in reqs) + slack
    res = simulate(policy, max_batch, lengths, prompts, kv, arrivals, wait)  # type: ignore[arg-type]
    assert res.generated == lengths
    assert all(f > a + n - 1 for f, a, n in zip(res.finish_steps, arrivals, lengths, strict=True))
    assert res.useful_tokens <= res.occupied_slot_steps <= max_batch * res.makespan
    assert res.useful_tokens <= res.slot_steps


def test_cli_prints_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--policy", "static,continuous", "--max-batch", "4", "--lengths", "8,4,3,10,2,5,7,1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    static, continuous = out.split("\n\n")
    for line in ("makespan            17 steps", "slot-steps          68",
                 "wasted slot-steps   28 (41.2%)", "tokens per step     2.353",
                 "raw occupancy       100.0%", "slot efficiency     58.8%",
                 "r0=10 r1=10 r2=10 r3=10 r4=17 r5=17 r6=17 r7=17"):
        assert line in static
    for line in ("makespan            12 steps", "slot-steps          40",
                 "wasted slot-steps   0 (0.0%)", "tokens per step     3.333",
                 "raw occupancy       83.3%", "slot efficiency     100.0%",
                 "r0=8 r1=4 r2=3 r3=10 r4=5 r5=9 r6=12 r7=9"):
        assert line in continuous


def test_cli_prefill_padding_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", "static", "--max-batch", "4", "--prompt-lengths", "12,200,30,45"]) == 0
    assert "800 slots for 287 real tokens, 513 wasted (64.1%)" in capsys.readouterr().out


def test_cli_json_and_retraction_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--policy", "continuous", "--lengths", "8,4,3,10,2,5,7,1",
            "--prompt-lengths", ",".join(["10"] * 8), "--kv-tokens", "60", "--json"]
    assert main(argv) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert res["retractions"] > 0
    assert res["generated"] == LENGTHS


def test_cli_defaults_to_the_textbook_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policy", "continuous", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert res["generated"] == TEXTBOOK_LENGTHS
    assert res["makespan"] == 12


def test_cli_rejects_mismatched_lists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--lengths", "1,2", "--prompt-lengths", "1,2,3"])
    assert "one entry per request" in capsys.readouterr().err
