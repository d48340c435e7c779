"""Structured outputs with the real SmolLM2 through the offline `Engine`: a 135M model does not
write valid JSON by itself; under the grammar every reply is in the constraint's language.

One engine for the module, one `chat` call for all the JSON-schema requests (greedy and
sampled), so the whole check is one batch."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import msgspec
import pytest

from bench import json_closeout as bench_json
from common.messages import SamplingParams, StructuredOutputs
from common.tool_calls import MAX_PARALLEL_TOOL_CALLS
from services.gateway import constraints
from tests.data.json_schemas import NESTED_SCHEMAS, SCHEMAS
from tokenline import Engine


@pytest.fixture(scope="module")
def engine():
    return Engine(max_total_tokens=40000)


def _chat(engine, prompts: list[str], constraints: list[StructuredOutputs],
          temperatures=(0.0, 0.8), max_tokens: int = 160):
    convs, params = [], []
    for temperature in temperatures:
        for i, (prompt, so) in enumerate(zip(prompts, constraints, strict=True)):
            convs.append([{"role": "user", "content": prompt}])
            params.append(SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                         seed=i, structured_outputs=so))
    return engine.chat(convs, params, use_tqdm=False), params


def test_twenty_json_schemas_greedy_and_sampled_validate(engine):
    outs, params = _chat(engine, [f"{p} Reply in JSON." for p, _ in SCHEMAS],
                         [StructuredOutputs(json=s) for _, s in SCHEMAS])
    assert len(outs) == 40
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", (out.text, out.error, p.temperature)
        jsonschema.validate(json.loads(out.text), p.structured_outputs.json)
        assert "\n" not in out.text  # compact: no free whitespace


def test_json_object_regex_choice_and_ebnf(engine):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    ebnf = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]*\nop ::= " + " | " * "'
    cases = [
        ("Describe your favourite animal as a JSON object.", StructuredOutputs(json_object=True)),
        ("Give me a date in ISO format.", StructuredOutputs(regex=date)),
        ("Is Paris in France? Answer yes or no.", StructuredOutputs(choice=["yes", "no"])),
        ("Which is a fruit?", StructuredOutputs(choice=["apple", "hammer", "cloud"])),
        ("Write an arithmetic expression.", StructuredOutputs(grammar=ebnf)),
    ]
    outs, params = _chat(engine, [c[0] for c in cases], [c[1] for c in cases], max_tokens=200)
    for out, p in zip(outs, params, strict=True):
        so = p.structured_outputs
        assert out.finish_reason == "stop", out.text
        if so.json_object:
            assert isinstance(json.loads(out.text), dict)
        elif so.regex:
            assert re.fullmatch(date, out.text), out.text
        elif so.choice:
            assert out.text in so.choice
        else:
            assert re.fullmatch(r"\([1-9][0-9]*(( \+ | \* )[1-9][0-9]*)*\)", out.text), out.text


def test_unconstrained_smollm2_does_not_follow_the_schema_alone(engine):
    """Why the grammar is needed: the same prompt without it is not JSON of that schema."""
    prompt, schema = SCHEMAS[5]
    [out] = engine.chat([{"role": "user", "content": f"{prompt} Reply in JSON."}],
                        SamplingParams(max_new_tokens=80, temperature=0.0), use_tqdm=False)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out.text), schema)


def test_bad_constraint_is_an_error_naming_the_field_and_the_engine_goes_on(engine):
    outs = engine.generate(["Hello", "Hello"], [
        SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(
            regex="(unclosed", param="structured_outputs.regex")),
        SamplingParams(max_new_tokens=4, temperature=0.0)], use_tqdm=False)
    assert outs[0].finish_reason == "error"
    assert "structured_outputs.regex" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def _shortest(error: str | None) -> int:
    """The shortest document's cost in tokens, from a refusal's message."""
    m = re.search(r"the shortest JSON the schema allows \((\d+) tokens", error or "")
    assert m, error
    return int(m.group(1))


def test_sampled_nested_json_always_closes_within_its_budget(engine):
    """Hot sampling over unbounded strings, numbers and arrays: every reply is valid JSON
    within max_tokens, or refused (a 400 naming max_tokens) because the budget is below the
    schema's shortest document; never cut by the budget (bench/json_closeout.py runs 500)."""
    convs, params = bench_json.requests(20, seed=1)
    for p, budget in zip(params, itertools.cycle((20, 32, 48, 64)), strict=False):
        p.max_new_tokens = budget
    outs = engine.chat(convs, params, use_tqdm=False)
    outcomes = [bench_json.outcome(o, p) for o, p in zip(outs, params, strict=True)]
    assert set(outcomes) <= {"valid", "refused"}, [o.text for o in outs]
    assert outcomes.count("valid") >= 15
    for out, p, kind in zip(outs, params, outcomes, strict=True):
        if kind == "refused":
            assert _shortest(out.error) > p.max_new_tokens
        else:
            assert len(out.token_ids) <= p.max_new_tokens


def test_budget_of_exactly_the_shortest_document_closes_and_one_less_is_refused(engine):
    prompt, schema = NESTED_SCHEMAS[8]  # an order: a customer with an address, lines, a total
    so = StructuredOutputs(json=schema, param="response_format")
    conv = [{"role": "user", "content": f"{prompt} Reply in JSON."}]
    [refused] = engine.chat(conv, SamplingParams(max_new_tokens=4, structured_outputs=so),
                            use_tqdm=False)
    assert refused.finish_reason == "error" and "max_tokens" in refused.error
    shortest = _shortest(refused.error)
    outs = engine.chat([conv] * 3, [SamplingParams(max_new_tokens=n, temperature=1.0, seed=n,
                                                   structured_outputs=so)
                                    for n in (shortest - 1, shortest, shortest + 3)],
                       use_tqdm=False)
    assert outs[0].finish_reason == "error" and "max_tokens" in outs[0].error
    for out in outs[1:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"}}}}}


def test_required_tool_calls_end_as_tool_calls_at_every_budget(engine):
    """SmolLM2 writes the same call again and again: one call without parallel calls, at most
    MAX_PARALLEL_TOOL_CALLS with them, and the reply ends as complete calls whatever the
    budget (the gateway's finish_reason "tool_calls"), never a list cut by max_tokens."""
    conv = [{"role": "user", "content": "What is the weather like in Paris?"}]
    tools = [msgspec.convert(WEATHER, constraints.Tool)]
    convs, params, plans = [], [], []
    for parallel in (False, True):
        so, plan, as_dicts = constraints.chat_plan(tools, "required", parallel, None, None)
        for budget in (24, 40, 64, 400):
            convs.append(conv)
            params.append(SamplingParams(max_new_tokens=budget, temperature=0.9, seed=budget,
                                         structured_outputs=so))
            plans.append(plan)
    outs = engine.chat(convs, params, use_tqdm=False, tools=as_dicts)
    counts = []
    for out, plan in zip(outs, plans, strict=True):
        msg, reason = constraints.message(out.text, plan, out.finish_reason)
        assert reason == "tool_calls", out.text
        counts.append(len(msg["tool_calls"]))
        for call in msg["tool_calls"]:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                WEATHER["function"]["parameters"])
    assert counts[:4] == [1, 1, 1, 1]
    assert all(1 <= n <= MAX_PARALLEL_TOOL_CALLS for n in counts[4:]), counts
