"""The offline API: `tokenline.Engine(...).generate(...)` on the engine core, no NATS."""

from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from tokenline import Engine

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(str(tiny_model_dir), max_total_tokens=4096, debug_check_integrity=True)


def test_results_come_back_in_input_order_though_requests_finish_out_of_order(engine):
    lengths = [12, 2, 7, 1, 5]
    prompts = [[1000 + i, 2000 + i, 3000 + i] for i in range(len(lengths))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY) for n in lengths]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.index for o in outs] == list(range(len(lengths)))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == lengths
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[1].finish_time < outs[0].finish_time  # the short one really finished first
    assert all(o.ttft is not None and 0 <= o.ttft <= o.latency for o in outs)
    engine.core.check_integrity()


def test_string_and_token_id_prompts_give_the_same_tokens(engine):
    text = "The capital of France is"
    ids = engine.tokenizer.encode(text).ids
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, **GREEDY)
    by_text, by_ids, by_dict = engine.generate(
        [text, ids, {"prompt_token_ids": ids}], params, use_tqdm=False
    )
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids == by_dict.token_ids
    assert by_text.text == engine.tokenizer.decode(by_text.token_ids)
    # one bare prompt, either kind, is a batch of one
    assert engine.generate(ids, params, use_tqdm=False)[0].token_ids == by_ids.token_ids
    assert engine.generate(text, params, use_tqdm=False)[0].token_ids == by_ids.token_ids


def _stop_candidate(engine, token_ids: list[int]) -> str:
    """A visible piece of text that the greedy output produces a few tokens in."""
    for t in token_ids[3:]:
        piece = engine.tokenizer.decode([t])
        if piece.strip() and piece.isprintable():
            return piece.strip()
    raise AssertionError(f"no visible text to stop on in {token_ids}: pick another prompt")


def test_stop_string_is_trimmed_unless_asked_for(engine):
    prompt = [1100, 1200, 1300, 1400]
    free = engine.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True, **GREEDY),
                           use_tqdm=False)[0]
    stop = _stop_candidate(engine, free.token_ids)
    at = free.text.find(stop)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop], **GREEDY)
    trimmed = engine.generate(prompt, params, use_tqdm=False)[0]
    assert trimmed.finish_reason == "stop" and trimmed.matched_stop == stop
    assert trimmed.text == free.text[:at]
    assert stop not in trimmed.text
    assert trimmed.token_ids == free.token_ids[: len(trimmed.token_ids)]
    params.include_stop_str_in_output = True
    kept = engine.generate(prompt, params, use_tqdm=False)[0]
    assert kept.text == free.text[: at + len(stop)]


def test_progress_bar_shows_only_when_asked(engine, capsys):
    params = SamplingParams(max_new_tokens=2, **GREEDY)
    engine.generate([[1000, 1001]] * 2, params, use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err
    engine.generate([[1000, 1001]] * 2, params, use_tqdm=True)
    assert "Generating" in capsys.readouterr().err


def test_sampling_params_as_a_dict_with_openai_names(engine):
    outs = engine.generate([[1000, 1001], [1002]], {"max_tokens": 3, "temperature": 0,
                                                    "ignore_eos": True}, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="tmperature"):
        engine.generate([[1000]], {"tmperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts"):
        engine.generate([[1000], [1001]], [SamplingParams()], use_tqdm=False)


def test_default_sampling_params_give_a_short_completion(engine):
    out = engine.generate([[1000, 1001]], {"ignore_eos": True}, use_tqdm=False)[0]
    assert len(out.token_ids) == 16


def test_a_prompt_longer_than_the_context_comes_back_as_an_error(engine):
    too_long = [1000] * (engine.core.max_model_len + 1)
    bad, good = engine.generate([too_long, [1000, 1001]], SamplingParams(max_new_tokens=2),
                                use_tqdm=False)
    assert bad.finish_reason == "error" and "context length" in bad.error
    assert good.finish_reason in ("length", "stop") and good.token_ids
    engine.core.check_integrity()


def test_chat_renders_the_template_then_generates(engine):
    messages = [{"role": "user", "content": "Hello!"}]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, **GREEDY)
    out = engine.chat(messages, params, use_tqdm=False)[0]
    template = engine.tokenizer.encode(
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    ).ids
    assert out.prompt_token_ids[-len(template):] == template
    again = engine.generate([out.prompt_token_ids], params, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids


def test_unknown_or_bad_engine_flags_fail_before_loading_anything(tiny_model_dir):
    with pytest.raises(TypeError, match="max_totl_tokens"):
        Engine(str(tiny_model_dir), max_totl_tokens=100)
    with pytest.raises(ValueError, match="batching"):
        Engine(str(tiny_model_dir), batching="sometimes")


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_older_batching_policies_give_the_same_greedy_tokens(engine, tiny_model_dir, batching):
    prompts = [[1000 + 7 * i, 1500 + i, 2500] for i in range(5)]
    params = [SamplingParams(max_new_tokens=2 + i, ignore_eos=True, **GREEDY) for i in range(5)]
    other = Engine(str(tiny_model_dir), max_total_tokens=2048, batching=batching,
                   max_running_requests=2)
    want = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in other.generate(prompts, params, use_tqdm=False)] == want


def test_real_model_text_equals_transformers_generate(smol_path):
    """The check the engine is held to, through the offline API: SmolLM2, greedy, float32."""
    from transformers import AutoModelForCausalLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    engine = Engine(None, max_total_tokens=2048)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, **GREEDY), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        if 2 in ref:  # generate pads after EOS; the engine stops there
            ref = ref[: ref.index(2) + 1]
        assert out.token_ids == ref, prompt
        assert out.text == engine.tokenizer.decode(ref, skip_special_tokens=True)
