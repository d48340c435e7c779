"""The close-out's closing (services/scheduler/core/closeout.py) with xgrammar and SmolLM2's
tokenizer: from the start of every schema we test with, and from inside a string, an escape, a
number, an array and a character cut after its first bytes (a token may end inside one), the
closing finishes a document that validates, in few tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.modelstore import model_info
from services.scheduler.core.closeout import CloseoutState
from services.scheduler.core.grammar import XGrammarBackend
from tests.data.json_schemas import NESTED_SCHEMAS, SCHEMAS


@pytest.fixture(scope="module")
def backend(smol_path) -> XGrammarBackend:
    info = model_info(smol_path, None, None, None)
    return XGrammarBackend(info.tokenizer_json, 49152, sorted(info.eos_token_ids))


def _close(backend, schema: dict, prefix: str | bytes = "") -> tuple[str, list[int]]:
    matcher = backend.matcher(backend.compile("json", json.dumps(schema))).m
    prefix = prefix.encode() if isinstance(prefix, str) else prefix
    assert matcher.accept_string(prefix)
    closer = backend.closer()
    state = CloseoutState()
    state.scan(prefix)
    path = closer.closing(matcher, state)
    assert path is not None and path[-1] == closer.stop_id
    for token in path:  # the real matcher takes every token and ends
        assert matcher.accept_token(token)
    assert matcher.is_terminated()
    return (prefix + b"".join(closer.vocab[t] for t in path[:-1])).decode(), path


@pytest.mark.parametrize("i", range(len(SCHEMAS) + len(NESTED_SCHEMAS)))
def test_closing_from_the_start_is_a_valid_document(backend, i):
    schema = (SCHEMAS + NESTED_SCHEMAS)[i][1]
    text, _ = _close(backend, schema)
    jsonschema.validate(json.loads(text), schema)


def test_closing_writes_the_smallest_values_in_few_tokens(backend):
    text, path = _close(backend, SCHEMAS[0][1])
    assert text == '{"name": "", "age": 0}'
    assert len(path) == 11  # {" name ": ""  ,  " age ": 0 } and the stop token


@pytest.mark.parametrize("prefix", [
    '{"name": "Par', '{"name": "a\\', '{"name": "a\\"', '{"name": "x", "location": {"lat": -1.',
    '{"name": "x", "location": {"lat": 1e', '{"name": "caf\u00e9'.encode()[:-1],
    '{"name": "\u7d00'.encode()[:-1], '{"name": "x", "location": {"lat": 2, "lon": 3}, '
    '"populations": [1, 2', '{"name": "x", "location": {"lat": 2, "lon": 3}, "populations": ['])
def test_closing_from_inside_strings_escapes_numbers_and_arrays(backend, prefix):
    schema = NESTED_SCHEMAS[0][1]
    text, _ = _close(backend, schema, prefix)
    jsonschema.validate(json.loads(text), schema)


def test_the_closer_is_built_once_in_a_compile_thread_before_the_first_json_compile(smol_path):
    """Building it walks the whole vocabulary (0.2 s with Gemma 3's): the engine's thread, where
    every running request would wait, only picks it up. A regex constraint does not build it."""
    import threading

    from common.messages import StructuredOutputs
    from services.scheduler.core import closeout
    from services.scheduler.core.grammar import GrammarCompiler

    info = model_info(smol_path, None, None, None)
    backend = XGrammarBackend(info.tokenizer_json, 49152, sorted(info.eos_token_ids))
    built: list[str] = []
    real_init = closeout.JsonCloser.__init__

    def counting_init(self, *args, **kwargs):
        built.append(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    closeout.JsonCloser.__init__ = counting_init
    compiler = GrammarCompiler(backend, timeout_s=30)
    try:
        compiler.submit(StructuredOutputs(regex="[a-z]+")).future.result(timeout=60)
        assert built == []
        for schema in ({"type": "object"}, {"type": "array"}):
            compiler.submit(StructuredOutputs(json=schema)).future.result(timeout=60)
        compiler.submit(StructuredOutputs(json_object=True)).future.result(timeout=60)
        assert len(built) == 1 and built[0].startswith("grammar-compile"), built
        assert backend.closer() is backend.closer() and len(built) == 1
    finally:
        closeout.JsonCloser.__init__ = real_init
        compiler.shutdown()
