"""Grammar-constrained decoding inside the engine core (tiny random model: the mask, not the
model, decides what a constrained request may say).

A constrained request beside unconstrained ones changes none of their tokens; retraction and
migration give the same tokens as an uninterrupted run; every bad constraint ends its request
with a 400 naming the field and the engine goes on serving."""

from __future__ import annotations

import json
import random
import re

import pytest

from common.messages import AbortReq, SamplingParams, StructuredOutputs, TokenizedReq
from services.scheduler.core.engine import EngineCore
from services.scheduler.core.request import Status
from tests.helpers import engine_args, run_engine

REGEX = r"[a-z]{3,8}(-[0-9]{2,4}){1,3}"
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}


def _req(rid: str, so: StructuredOutputs | None, seed: int = 0, max_new: int = 24,
         output_ids: list[int] | None = None, temperature: float = 0.0) -> TokenizedReq:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(8, 30))]
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=prompt,
                        params=SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                              seed=seed, structured_outputs=so),
                        output_ids=output_ids or [])


def _constraint(i: int) -> StructuredOutputs:
    kinds = [StructuredOutputs(regex=REGEX, param="regex"),
             StructuredOutputs(json=SCHEMA, param="json"),
             StructuredOutputs(choice=["alpha", "beta", "gamma"], param="choice")]
    return kinds[i % 3]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineCore(engine_args(tiny_model_dir, max_total_tokens=16384,
                                  debug_check_integrity=True))


def _text(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids)


def test_constrained_and_unconstrained_in_one_batch_of_32(engine):
    # unconstrained: greedy (the engine's batch invariance is a greedy one); constrained:
    # greedy and sampled
    reqs = [_req(f"m{i}", _constraint(i), seed=i, max_new=16, temperature=0.8 * (i % 4 == 3))
            if i % 2 else _req(f"m{i}", None, seed=i, max_new=16) for i in range(32)]
    mixed, finish, _ = run_engine(engine, reqs)
    for r in reqs:
        if r.params.structured_outputs is not None:
            continue
        alone, _, _ = run_engine(engine, [_req(f"solo-{r.rid}", None, seed=r.params.seed,
                                               max_new=16)])
        assert mixed[r.rid] == alone[f"solo-{r.rid}"], r.rid
    for r in reqs:
        so = r.params.structured_outputs
        if so is None:
            continue
        text, fin = _text(engine, mixed[r.rid]), finish[r.rid]
        if fin.kind == "stop":  # the grammar closed: the text is in its language
            if so.regex:
                assert re.fullmatch(REGEX, text), text
            elif so.choice:
                assert text in so.choice
            else:
                assert set(json.loads(text)) == set(SCHEMA["required"])
        elif so.json is not None:  # JSON is never cut: refused if the budget cannot hold it
            assert fin.kind == "error" and fin.param == "max_tokens", fin
        else:
            assert fin.kind == "length"
    engine.check_integrity()


def test_retracted_constrained_request_resumes_with_the_same_tokens(tiny_model_dir, engine):
    """Retraction keeps each request's matcher: under a pool that retracts again and again,
    greedy constrained requests give exactly the tokens of an uninterrupted run, and sampled
    ones stay inside their grammar all the way (a lost or reset matcher would let them out).

    Sampled tokens are not compared one for one: a retracted request's recompute prefill
    computes its last logits in another order than the decode steps it replaces (measured on
    this model: up to 2.6e-6 apart, logits up to 4), which can move a sampled token at
    temperature 0.7 when its draw sits that close to a boundary (seen: one request of 24, in
    some processes and not others)."""
    long = [StructuredOutputs(regex="[a-z ]+"), StructuredOutputs(regex="[0-9]+"),
            StructuredOutputs(json={"type": "object", "required": ["text"], "properties": {
                "text": {"type": "string"}}})]  # unbounded: most run to max_new
    reqs = [_req(f"p{i}", long[i % 3], seed=i, max_new=40, temperature=0.7 * (i % 2))
            for i in range(24)]
    ample, finish, _ = run_engine(engine, reqs)
    assert all(f.kind in ("stop", "length") for f in finish.values())
    tight = EngineCore(engine_args(tiny_model_dir, max_total_tokens=480, page_size=8,
                                   schedule_conservativeness=0.0, debug_check_integrity=True))
    squeezed, tight_finish, _ = run_engine(tight, reqs)
    assert tight.scheduler.num_retractions_total >= 3
    greedy = [r.rid for r in reqs if r.params.temperature == 0]
    assert {rid: squeezed[rid] for rid in greedy} == {rid: ample[rid] for rid in greedy}
    for i, r in enumerate(reqs):
        text = _text(tight, squeezed[r.rid])
        kind = tight_finish[r.rid].kind
        assert kind in ("stop", "length"), (r.rid, kind)
        if i % 3 == 0:
            assert re.fullmatch("[a-z ]*", text), (r.rid, text)
        elif i % 3 == 1:
            assert re.fullmatch("[0-9]*", text), (r.rid, text)
        elif kind == "stop":
            assert isinstance(json.loads(text)["text"], str), (r.rid, text)
        else:  # cut at max_new inside the object: what came is its start
            assert re.match(r'\{"text":\s*"', text), (r.rid, text)
    tight.check_integrity()
    assert tight.pool.num_used == 0


def test_moved_request_replays_its_tokens_into_the_matcher(engine):
    so = StructuredOutputs(json=SCHEMA, param="response_format")
    whole, _, _ = run_engine(engine, [_req("whole", so, seed=5, max_new=40, temperature=0.9)])
    head = whole["whole"][:7]
    resumed, finish, _ = run_engine(engine, [_req("moved", so, seed=5, max_new=40,
                                                  temperature=0.9, output_ids=head)])
    assert head + resumed["moved"] == whole["whole"]
    bad, finish, _ = run_engine(engine, [_req("bad-resume", so, output_ids=[504, 504])])
    assert finish["bad-resume"].kind == "error" and finish["bad-resume"].status == 400


@pytest.mark.parametrize("so, field, words", [
    (StructuredOutputs(json='{"type": "nonsense"}', param="response_format"),
     "response_format", "nonsense"),
    (StructuredOutputs(json="{not json", param="structured_outputs.json"),
     "structured_outputs.json", "json"),
    (StructuredOutputs(regex="[a-", param="structured_outputs.regex"),
     "structured_outputs.regex", "regex"),
    (StructuredOutputs(grammar="root ::= foo", param="sampling_params.ebnf"),
     "sampling_params.ebnf", "foo"),
    (StructuredOutputs(choice=[], param="structured_outputs.choice"),
     "structured_outputs.choice", "choice"),
    (StructuredOutputs(regex="a", grammar='root ::= "a"', param="structured_outputs"),
     "structured_outputs", "regex and grammar"),
])
def test_bad_constraint_fails_with_400_naming_the_field(engine, so, field, words):
    reqs = [_req("bad", so), _req("next", None)]
    tokens, finish, _ = run_engine(engine, reqs)
    assert finish["bad"].kind == "error" and finish["bad"].status == 400
    assert finish["bad"].param == field
    assert words.lower() in finish["bad"].message.lower()
    assert finish["next"].kind == "length" and len(tokens["next"]) == 24
    engine.check_integrity()


def test_compile_slower_than_the_timeout_fails_with_400(engine):
    engine.grammars.timeout_s = 0.0  # what --grammar-compile-timeout 0 would set
    try:
        # a schema that takes xgrammar seconds to compile (a long minimum string length)
        so = StructuredOutputs(json={"type": "object", "required": ["text"], "properties": {
            "text": {"type": "string", "minLength": 300}}}, param="response_format")
        _, finish, _ = run_engine(engine, [_req("slow", so)])
    finally:
        engine.grammars.timeout_s = 10.0
    assert finish["slow"].kind == "error" and finish["slow"].status == 400
    assert "--grammar-compile-timeout" in finish["slow"].message
    assert finish["slow"].param == "response_format"
    tokens, finish, _ = run_engine(engine, [_req("after", None)])
    assert finish["after"].kind == "length"


def test_grammar_that_allows_no_token_ends_with_an_error(engine):
    # min_tokens bans EOS while the grammar, complete after "alpha", allows nothing else
    req = _req("stuck", StructuredOutputs(choice=["alpha"], param="structured_outputs.choice"))
    req.params.min_new_tokens = 20
    tokens, finish, _ = run_engine(engine, [req, _req("fine", None)])
    assert finish["stuck"].kind == "error" and finish["stuck"].status == 400
    assert "grammar" in finish["stuck"].message
    assert finish["fine"].kind == "length"


def test_abort_while_the_grammar_compiles_frees_the_request(engine):
    so = StructuredOutputs(json={**SCHEMA, "title": "abort me"}, param="response_format")
    engine.submit(_req("gone", so))
    engine.abort(AbortReq(rid="gone"))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [o.finish.kind for o in outs if o.rid == "gone"] == ["abort"]
    assert not engine.compiling and not engine.requests


def test_waiting_for_grammar_holds_back_no_one(engine):
    so = StructuredOutputs(json={**SCHEMA, "title": "fresh"}, param="response_format")
    engine.submit(_req("plain", None))
    engine.submit(_req("constrained", so))
    engine.step()
    plain = engine.requests["plain"]
    assert plain.status is Status.RUNNING and plain.num_computed > 0
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert stats["grammar_requests_total"] >= 1
    assert sum(stats["grammar_compile_buckets"]) >= 1


def test_the_vocabulary_is_read_at_the_first_constraint_and_not_timed_as_its_compile(
        tiny_model_dir, monkeypatch):
    """A server that never sees a constraint never reads the vocabulary into xgrammar (seconds
    of every start); the first constraint waits for it in a compile thread, and that wait is
    not its compile time: with a 1 s timeout and a 2 s read, its JSON still comes."""
    import time

    from services.scheduler.core import grammar

    read = grammar._tokenizer_info

    def slow_read(*args):
        time.sleep(2.0)
        return read(*args)

    grammar._tokenizer_info.cache_clear()  # earlier engines in this process read it already
    monkeypatch.setattr(grammar, "_tokenizer_info", slow_read)
    engine = EngineCore(engine_args(tiny_model_dir, grammar_compile_timeout=1.0))
    tokens, finish, _ = run_engine(engine, [_req("plain", None)])
    assert finish["plain"].kind == "length"
    assert not engine.grammars.backend._prepared  # served, and nothing read
    so = StructuredOutputs(json=SCHEMA, param="json")
    tokens, finish, _ = run_engine(engine, [_req("first", so, max_new=64)])
    assert engine.grammars.backend._prepared
    assert finish["first"].kind in ("stop", "length"), finish["first"].message
    doc = json.loads(_text(engine, tokens["first"]))
    assert set(doc) == {"id", "ok", "tag"}
    engine.check_integrity()
