"""Bad input never crashes a service: every refusal is a 4xx in OpenAI's error shape naming the
field (Anthropic's on /v1/messages), a fuzzer driven by /openapi.json finds no 5xx, and the books
balance afterwards.

One stack for the module, guarded by an API key, over a NATS server that wants a user and
password (so the credentials must have reached every service for anything to work).
"""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from services.gateway.openapi import spec
from services.gateway.protocol import MAX_JSON_DEPTH
from services.gateway.responses import MAX_INPUT_ITEMS
from tests.e2e.reliability import (
    SERVICES,
    assert_books_balance,
    assert_openai_error,
    cmdline,
    service_pids,
    tiny_stack,
)

pytestmark = pytest.mark.timeout(300)

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
NATS_PASSWORD = "nats-secret-1b9"
CONTEXT = 64  # short: generation runs to it when max_tokens is not given (96: the fuzzer took
# 80-100 s; the same requests succeed at 64, 203 chat, 128 responses, 172 completions)
MAX_BYTES = 1024 * 1024  # room for 100,000 levels of nesting: a 400 for the depth, not a 413
EXAMPLES_PER_ROUTE = 25
FUZZ_SEED = 20261204  # the same cases every run: a failure reproduces, the budget holds


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--api-key", KEY, "--nats-user", "tokenline",
                    "--nats-password", NATS_PASSWORD, "--max-request-bytes", str(MAX_BYTES),
                    "--max-stop-strings", "4", max_model_len=CONTEXT) as s:
        yield s


def post(stack, path: str, body, headers: dict | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(stack.url + path, data=data, timeout=60,
                         headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


# -- validation -------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GEN = "/generate"
RESP = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic's: its own error body
HI = [{"role": "user", "content": "hi"}]

# (route, body, status, param, words the message must contain)
BAD = {
    "invalid JSON": (CMPL, b'{"prompt": "hi", ', 400, None, ["JSON"]),
    "not an object": (CMPL, b'[1, 2]', 400, None, []),
    "invalid UTF-8": (CMPL, b'{"prompt": "\xff\xfe"}', 400, None, ["UTF-8"]),
    "missing prompt": (CMPL, {"max_tokens": 2}, 400, "prompt", ["prompt"]),
    "prompt wrong type": (CMPL, {"prompt": 5}, 400, "prompt", []),
    "max_tokens wrong type": (CMPL, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens",
                              ["int"]),
    "n a float": (CMPL, {"prompt": "hi", "n": 1.5}, 400, "n", []),
    "messages not a list": (CHAT, {"messages": "hi"}, 400, "messages", []),
    "temperature < 0": (CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature", []),
    "top_p = 0": (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p", []),
    "top_p > 1": (CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p", []),
    "top_k < -1": (CMPL, {"prompt": "hi", "top_k": -2}, 400, "top_k", []),
    "top_k = 0": (CMPL, {"prompt": "hi", "top_k": 0}, 400, "top_k", []),
    "max_tokens = 0": (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", []),
    "max_completion_tokens = 0": (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400,
                                  "max_completion_tokens", []),
    "max_new_tokens = 0": (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400,
                           "sampling_params.max_new_tokens", []),
    "generate temperature < 0": (GEN, {"text": "hi", "sampling_params": {"temperature": -1}},
                                 400, "sampling_params.temperature", []),
    "prompt + max_tokens over the context": (
        CMPL, {"prompt": "hello there", "max_tokens": 300}, 400, "max_tokens",
        [str(CONTEXT), "300"]),
    "chat + max_tokens over the context": (
        CHAT, {"messages": HI, "max_tokens": CONTEXT}, 400, "max_tokens", [str(CONTEXT)]),
    "prompt alone over the context": (CMPL, {"prompt": [7] * (CONTEXT + 1)}, 400, "prompt",
                                      [str(CONTEXT)]),
    "empty messages": (CHAT, {"messages": []}, 400, "messages", ["empty"]),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "messages[0].role", ["wizard"]),
    "message not an object": (CHAT, {"messages": ["hi"]}, 400, "messages[0]", []),
    "message content a number": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
                                 "messages[0].content", []),
    "integer beyond 64 bits in a message": (
        CHAT, {"messages": [{"role": "user", "content": "hi", "x": 2**70}]}, 400, "messages",
        []),
    "unknown model": (CMPL, {"model": "gpt-17", "prompt": "hi"}, 404, "model", ["gpt-17"]),
    "too many stop strings": (CMPL, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
                              "stop", ["5", "4"]),
    "empty stop string": (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop", []),
    "n = 0": (CMPL, {"prompt": "hi", "n": 0}, 400, "n", []),
    "n too large": (CHAT, {"messages": HI, "n": 17}, 400, "n", []),
    "generate n too large": (GEN, {"text": "hi", "sampling_params": {"n": 99}}, 400,
                             "sampling_params.n", []),
    "logprobs > 20": (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", []),
    "logprobs < 0": (CMPL, {"prompt": "hi", "logprobs": -1}, 400, "logprobs", []),
    "top_logprobs > 20": (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400,
                          "top_logprobs", []),
    "top_logprobs_num > 20": (GEN, {"text": "hi", "return_logprob": True,
                                    "top_logprobs_num": 21}, 400, "top_logprobs_num", []),
    "token id outside the vocabulary": (CMPL, {"prompt": [1, 10**9]}, 400, "prompt",
                                        ["vocabulary"]),
    "negative token id": (GEN, {"input_ids": [1, -3]}, 400, "input_ids[1]", []),
    "booleans as token ids": (CMPL, {"prompt": [True, False]}, 400, "prompt", []),
    "priority beyond 64 bits": (CMPL, {"prompt": "hi", "priority": 2**70}, 400, "priority", []),
    "seed beyond 64 bits": (CHAT, {"messages": HI, "seed": -(2**80)}, 400, "seed", []),
    # free-form JSON sent on to the tokenizer and scheduler (msgpack: 64-bit integers)
    "tool schema integer beyond 64 bits": (
        CHAT, {"messages": HI, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "maxProperties": -(2**100)}}}]},
        400, "tools[0]", ["cannot be sent on"]),
    "response_format schema integer beyond 64 bits": (
        CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "maxProperties": 2**70}}}},
        400, "response_format.json_schema.schema", ["cannot be sent on"]),
    "structured_outputs json integer beyond 64 bits": (
        CMPL, {"prompt": "hi", "structured_outputs": {"json": {"maxLength": 2**65}}},
        400, "structured_outputs.json", ["cannot be sent on"]),
    "logit_bias out of range": (CMPL, {"prompt": "hi", "logit_bias": {"5": 500}}, 400,
                                "logit_bias[...]", []),
    "logit_bias key not a token": (CMPL, {"prompt": "hi", "logit_bias": {"x": 1}}, 400,
                                   "logit_bias", []),
    "min_tokens above max_tokens": (CMPL, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
                                    400, "min_tokens", []),
    "text and input_ids": (GEN, {"text": "hi", "input_ids": [1]}, 400, "text", []),
    # a field we do not implement is refused by name, never accepted and ignored
    "unknown field": (CMPL, {"prompt": "hi", "frobnicate": {"x": [1]}}, 400, "frobnicate",
                      ["unknown field", "frobnicate"]),
    "vLLM's older guided_json": (CHAT, {"messages": HI, "guided_json": {"type": "object"}}, 400,
                                 "guided_json", ["structured_outputs.json"]),
    "OpenAI's older functions": (CHAT, {"messages": HI, "functions": []}, 400, "functions",
                                 ["tools"]),
    "an OpenAI field we lack": (CHAT, {"messages": HI, "audio": {"voice": "alloy"}}, 400,
                                "audio", []),
    "unknown field in stream_options": (CHAT, {"messages": HI, "stream": True, "stream_options":
                                               {"include_usage": True, "x": 1}}, 400,
                                        "stream_options.x", []),
    "unknown field in a tool": (CHAT, {"messages": HI, "tools": [{"type": "function", "function":
                                {"name": "f", "parameters": {}, "examples": []}}]}, 400,
                                "tools[0].function.examples", []),
    "unknown field in response_format": (CMPL, {"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}, "schema_version": 2}}}, 400,
        "response_format.json_schema.schema_version", []),
    "unknown sampling param": (GEN, {"text": "hi", "sampling_params": {"max_tokens": 3}}, 400,
                               "sampling_params.max_tokens", []),
    "unknown /generate field": (GEN, {"text": "hi", "guided_json": {}}, 400, "guided_json",
                                []),
    "unknown /abort_request field": ("/abort_request", {"rid": "r", "everything": True}, 400,
                                     "everything", ["unknown field"]),
    # the Responses API: its fields named as its body names them
    "responses unknown item type": (RESP, {"input": [{"type": "reasoning", "summary": []}]},
                                    400, "input[0].type", ["reasoning"]),
    "responses item not an object": (RESP, {"input": ["hi"]}, 400, "input[0]", []),
    "responses input list too long": (RESP, {"input": HI * (MAX_INPUT_ITEMS + 1)}, 400,
                                      "input", [str(MAX_INPUT_ITEMS)]),
    "responses image content": (RESP, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
        "input[0].content[0].type", []),
    "responses unknown text.format": (RESP, {"input": "hi", "text": {"format": {"type": "xml"}}},
                                      400, "text.format.type", []),
    "responses json_schema without a schema": (
        RESP, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
        "text.format.schema", []),
    "responses built-in tool": (RESP, {"input": "hi", "tools": [{"type": "web_search"}]}, 400,
                                "tools[0].type", ["web_search"]),
    "responses store": (RESP, {"input": "hi", "store": True}, 400, "store", []),
    "responses previous_response_id": (RESP, {"input": "hi", "previous_response_id": "resp_1"},
                                       400, "previous_response_id", []),
    "responses include": (RESP, {"input": "hi", "include": ["message.output_text.logprobs"]},
                          400, "include", ["message.output_text.logprobs"]),
    "responses max_output_tokens over the context": (
        RESP, {"input": "hi", "max_output_tokens": CONTEXT}, 400, "max_output_tokens",
        [str(CONTEXT)]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_gets_4xx_naming_the_field(stack, case):
    path, body, status, param, words = BAD[case]
    assert_openai_error(post(stack, path, body), status, param, *words)


def assert_anthropic_error(resp: requests.Response, status: int, err_type: str,
                           *contains: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == err_type, body
    for text in contains:
        assert text in body["error"]["message"], body


USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
# (body, status, Anthropic's error type, words the message must contain)
BAD_MESSAGES = {
    "missing max_tokens": ({"model": "tiny", "messages": HI}, 400, "invalid_request_error",
                           ["max_tokens"]),
    "a message of no role": ({"model": "tiny", "max_tokens": 2, "messages": [{"content": "x"}]},
                             400, "invalid_request_error", ["messages[0]"]),
    "content a number": ({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": 5}]}, 400, "invalid_request_error", ["messages[0].content"]),
    "a block of an unknown type": ({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
        "invalid_request_error", ["messages[0].content[0].type", "document"]),
    "a tool_use in a user message": ({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [USE]}]}, 400, "invalid_request_error", ["tool_use"]),
    "tool_result without its tool_use": ({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
        400, "invalid_request_error", ["toolu_9"]),
    "a huge messages list": ({"model": "tiny", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "x"}] * 100_001},
                             413, "request_too_large", [str(MAX_BYTES)]),
    "an unknown model": ({"model": "claude-x", "max_tokens": 2, "messages": HI}, 404,
                         "not_found_error", ["claude-x"]),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES), ids=list(BAD_MESSAGES))
def test_bad_messages_input_gets_4xx_in_anthropics_shape(stack, case):
    body, status, err_type, words = BAD_MESSAGES[case]
    assert_anthropic_error(post(stack, MESSAGES, body), status, err_type, *words)


def test_messages_deep_nesting_and_keys_in_anthropics_shape(stack):
    deep = f'{{"model": "tiny", "max_tokens": 2, "messages": {nested(DEEP)}}}'.encode()
    assert_anthropic_error(post(stack, MESSAGES, deep), 400, "invalid_request_error",
                           "levels deep")
    body = {"model": "tiny", "max_tokens": 2, "messages": HI}
    resp = requests.post(stack.url + MESSAGES, json=body, timeout=10,
                         headers={"x-api-key": "wrong"})
    assert_anthropic_error(resp, 401, "authentication_error")
    resp = requests.post(stack.url + MESSAGES, json=body, timeout=60, headers={"x-api-key": KEY})
    assert resp.status_code == 200 and resp.json()["usage"]["output_tokens"] == 2, resp.text


def test_body_over_max_request_bytes_is_413(stack):
    big = {"prompt": "x" * (MAX_BYTES + 10), "max_tokens": 1}
    assert_openai_error(post(stack, CMPL, big), 413, None, str(MAX_BYTES))

    def chunks():  # no Content-Length: the limit still holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    resp = requests.post(stack.url + CMPL, data=chunks(), timeout=60,
                         headers={"Content-Type": "application/json", **AUTH})
    assert_openai_error(resp, 413, None)


DEEP = 100_000


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def deep_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


IDS, STRS, OBJ = nested(DEEP), nested(DEEP, '"a"'), deep_object(DEEP)
# (route, body as JSON text): 100,000 levels of nesting wherever a client could put them
DEEP_BODIES = {
    "chat messages": (CHAT, f'{{"messages": {IDS}}}'),
    "chat message content": (CHAT, f'{{"messages": [{{"role": "user", "content": {STRS}}}]}}'),
    "chat inside a message": (CHAT, f'{{"messages": [{{"role": "user", "x": {OBJ}}}]}}'),
    "completion prompt": (CMPL, f'{{"prompt": {IDS}}}'),
    "completion prompt token lists": (CMPL, f'{{"prompt": [[1, 2], {IDS}]}}'),
    "completion prompt strings": (CMPL, f'{{"prompt": ["hi", {STRS}]}}'),
    "completion stop": (CMPL, f'{{"prompt": "hi", "stop": {STRS}}}'),
    "completion logit_bias": (CMPL, f'{{"prompt": "hi", "logit_bias": {OBJ}}}'),
    "completion unknown field": (CMPL, f'{{"prompt": "hi", "x": {OBJ}}}'),
    "the body itself": (CMPL, IDS),
    "generate input_ids": (GEN, f'{{"input_ids": {IDS}}}'),
    "responses input": (RESP, f'{{"input": {IDS}}}'),
    "generate sampling_params": (GEN, f'{{"text": "hi", "sampling_params": {OBJ}}}'),
    "abort_request": ("/abort_request", f'{{"rid": {STRS}}}'),
    "abort_request object": ("/abort_request", OBJ),
    "flush_cache": ("/flush_cache", IDS),
}


@pytest.mark.parametrize("case", list(DEEP_BODIES), ids=list(DEEP_BODIES))
def test_deeply_nested_json_is_a_400_on_every_route(stack, case):
    path, text = DEEP_BODIES[case]
    assert_openai_error(post(stack, path, text.encode()), 400, None, "levels deep",
                        f"at most {MAX_JSON_DEPTH}")


def test_nesting_up_to_the_limit_is_decoded(stack):
    # decoded to the last level: the 400 is the prompt check's (it reads the decoded lists),
    # not the depth check's
    ok = f'{{"prompt": ["hi", {nested(MAX_JSON_DEPTH - 2)}], "max_tokens": 1}}'
    assert_openai_error(post(stack, CMPL, ok.encode()), 400, "prompt", "prompt must be")
    too_deep = f'{{"prompt": ["hi", {nested(MAX_JSON_DEPTH - 1)}], "max_tokens": 1}}'
    assert_openai_error(post(stack, CMPL, too_deep.encode()), 400, None, str(MAX_JSON_DEPTH))
    brackets_in_strings = json.dumps({"prompt": "hi", "max_tokens": 1,
                                      "user": "[" * 1000 + '\\"{' * 500})
    assert post(stack, CMPL, brackets_in_strings.encode()).status_code == 200


def test_unknown_route_and_method_keep_the_error_shape(stack):
    assert_openai_error(requests.get(stack.url + "/v1/nothing", headers=AUTH, timeout=10), 404)
    assert_openai_error(requests.get(stack.url + CMPL, headers=AUTH, timeout=10), 405)


def test_every_field_we_implement_is_accepted_together(stack):
    """The other side of refusing unknown fields: a body with every optional field of the
    completions route (at values that change nothing here) is served."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1,
            "top_k": -1, "min_p": 0, "n": 1, "stream": False, "stop": None,
            "stop_token_ids": [], "seed": 1, "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1, "logit_bias": {}, "ignore_eos": False, "min_tokens": 0,
            "skip_special_tokens": True, "include_stop_str_in_output": False, "priority": 0,
            "user": "u-1", "cache_salt": "s", "response_format": {"type": "text"},
            "logprobs": None, "echo": False, "best_of": 1, "suffix": None,
            "prompt_logprobs": None}
    resp = post(stack, CMPL, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_openai_client_sees_the_field_in_the_error(stack):
    import openai

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=HI)
    assert info.value.param == "model" and info.value.code == "model_not_found"
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


# -- auth ---------------------------------------------------------------------------------------
def test_api_key_is_required(stack):
    url = stack.url + CMPL
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = requests.post(url, json=body, headers=headers, timeout=10)
        err = assert_openai_error(resp, 401, None)
        assert err["code"] == "invalid_api_key"
    assert requests.post(url, json=body, headers=AUTH, timeout=60).status_code == 200
    # what probes and scrapers need stays open
    for path in ("/health", "/metrics", "/openapi.json"):
        assert requests.get(stack.url + path, timeout=10).status_code == 200, path
    assert requests.get(stack.url + "/v1/models", timeout=10).status_code == 401


def test_nats_credentials_reach_every_service_but_no_command_line(stack):
    import asyncio

    import nats
    import nats.errors

    nats_url = next(a for a in cmdline(service_pids(stack)["gateway"]) if a.startswith("nats:"))

    async def anonymous() -> None:
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=2)

    with pytest.raises(nats.errors.Error):  # the server wants the password...
        asyncio.run(anonymous())
    pids = service_pids(stack)
    assert set(pids) == set(SERVICES)
    for name, pid in pids.items():  # ...every service has it, and `ps` shows it nowhere
        assert NATS_PASSWORD not in " ".join(cmdline(pid)), name
        assert KEY not in " ".join(cmdline(pid)), name
    health = requests.get(stack.url + "/health", timeout=10)
    assert health.status_code == 200, health.text  # every stage heart-beats over NATS


# -- the fuzzer -------------------------------------------------------------------------------
def test_openapi_describes_every_route(stack):
    doc = requests.get(stack.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    for path in (CHAT, CMPL, GEN, RESP, MESSAGES, "/tokenize", "/detokenize", "/v1/models",
                 "/health",
                 "/metrics", "/flush_cache", "/abort_request", "/get_server_info",
                 "/openapi.json"):
        assert path in paths, path
    for path, body in ((CHAT, "ChatCompletionRequest"), (CMPL, "CompletionRequest"),
                       (GEN, "GenerateRequest"), (RESP, "ResponsesRequest"),
                       (MESSAGES, "MessagesRequest"),
                       ("/tokenize", "TokenizeRequest"),
                       ("/detokenize", "DetokenizeRequest")):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/" + body)
        assert "400" in paths[path]["post"]["responses"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    top_p = props["top_p"]["anyOf"][0]
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert doc["security"] == [{"bearer": []}]
    assert doc == json.loads(json.dumps(spec("tiny", api_key=True)))  # what the fuzzer reads


def openai_error_shape(ctx, response, case) -> bool | None:
    """Every refusal has OpenAI's body: {"error": {"message", "type", "param", "code"}}; on
    Anthropic's route Anthropic's: {"type": "error", "error": {"type", "message"}}."""
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path == MESSAGES:
        assert isinstance(body, dict) and body.get("type") == "error" and set(
            body.get("error", {})) == {"type", "message"}, (
            f"not Anthropic's error body: {response.text[:300]}")
        return True
    assert isinstance(body, dict) and set(body.get("error", {})) == {
        "message", "type", "param", "code"}, f"not OpenAI's error body: {response.text[:300]}"
    return True


def _fuzz_config() -> schemathesis.Config:
    config = schemathesis.Config()
    config.update(seed=FUZZ_SEED, max_failures=None)  # 4.32.5 gives it no default
    config.projects.default.generation.update(max_examples=EXAMPLES_PER_ROUTE, database="none")
    return config


# The same document the server serves (test_openapi_describes_every_route compares them); built
# here because the generated tests must exist before the stack does.
schema = schemathesis.openapi.from_dict(spec("tiny", api_key=True), config=_fuzz_config())


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(900)  # one route's cases, each generating up to CONTEXT tokens: on a busy
def test_fuzzed_requests_never_get_5xx(case, stack):  # 2-core machine that outgrew 300 s
    response = case.call(base_url=stack.url, headers=AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error, openai_error_shape])


def test_books_balance_after_all_of_the_above(stack):
    assert_books_balance(stack.url, AUTH)
    assert set(service_pids(stack)) == set(SERVICES)  # nobody crashed (or was restarted)
    assert "exited; restarting" not in stack.logs()
