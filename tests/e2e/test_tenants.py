"""Tenants cannot reach each other: the routes that change server state take only the admin
key, and `cache_salt` keeps one tenant's cached prefix from another (who could otherwise learn
from `cached_tokens`, or from TTFT, that someone sent the same prompt).

One stack for the module, with `--api-key user --admin-api-key admin`.
"""

from __future__ import annotations

import random

import openai
import pytest
import requests

from tests.e2e.reliability import assert_books_balance, assert_openai_error, tiny_stack

pytestmark = pytest.mark.timeout(300)

USER, ADMIN = "user-key-7f1", "admin-key-c42"
AS_USER = {"Authorization": f"Bearer {USER}"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
# 1,200 token ids: every route can send them (chat as text would tokenize differently)
PROMPT_IDS = [random.Random(21).randrange(1000, 40000) for _ in range(1200)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--api-key", USER, "--admin-api-key", ADMIN,
                    max_model_len=2048) as s:
        yield s


def post(stack, path: str, body: dict, headers: dict) -> requests.Response:
    return requests.post(stack.url + path, json=body, headers=headers, timeout=120)


# -- the admin key ------------------------------------------------------------------------------
def test_state_changing_routes_take_only_the_admin_key(stack):
    for path, body in (("/abort_request", {"abort_all": True}), ("/flush_cache", {})):
        for headers in (AS_USER, {}, {"Authorization": "Bearer wrong"},
                        {"Authorization": ADMIN}):  # the key without "Bearer "
            err = assert_openai_error(post(stack, path, body, headers), 401, None)
            assert err["code"] == "invalid_api_key"
        resp = post(stack, path, body, AS_ADMIN)
        assert resp.status_code == 200, resp.text
        assert resp.json()["success"] is True
    assert_openai_error(requests.get(stack.url + "/flush_cache", headers=AS_USER, timeout=10),
                        401, None)
    assert requests.get(stack.url + "/flush_cache", headers=AS_ADMIN, timeout=10).ok


def test_generation_and_reading_take_either_key(stack):
    for key in (USER, ADMIN):
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.usage.completion_tokens == 2
        cmpl = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert cmpl.usage.completion_tokens == 2
        assert [m.id for m in client.models.list()] == ["tiny"]
        headers = {"Authorization": f"Bearer {key}"}
        gen = post(stack, GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                   headers)
        assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] == 2
        info = requests.get(stack.url + "/get_server_info", headers=headers, timeout=10)
        assert info.status_code == 200 and info.json()["model"] == "tiny"
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)


# -- cache_salt ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bodies(smol_path) -> dict[str, dict]:
    """The same 1,200-token prompt for each route (the tiny model has SmolLM2's tokenizer)."""
    from tokenizers import Tokenizer

    from common.modelstore import model_info

    text = Tokenizer.from_file(str(model_info(smol_path).tokenizer_json)).decode(PROMPT_IDS)
    return {GEN: {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 1}},
            CMPL: {"prompt": PROMPT_IDS, "max_tokens": 1},
            CHAT: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}}


def cached_tokens(stack, path: str, body: dict, salt: str | None) -> int:
    """Send `body` once on `path` (with `salt` unless None); the cached_tokens reported."""
    body = dict(body)
    if salt is not None:
        body["cache_salt"] = salt
    resp = post(stack, path, body, AS_USER)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    if path == GEN:
        assert data["meta_info"]["prompt_tokens"] >= 1200
        return data["meta_info"]["cached_tokens"]
    assert data["usage"]["prompt_tokens"] >= 1200
    return data["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", [CHAT, CMPL, GEN])
def test_different_salts_share_no_cached_prefix(stack, bodies, path):
    body = bodies[path]
    assert post(stack, "/flush_cache", {}, AS_ADMIN).ok  # start cold: nothing from before
    assert cached_tokens(stack, path, body, "tenant-a") == 0
    assert cached_tokens(stack, path, body, "tenant-b") == 0  # the same 1,200 tokens
    assert cached_tokens(stack, path, body, None) == 0  # no salt is not any salt
    assert cached_tokens(stack, path, body, "tenant-a") >= 1000  # the same salt shares
    assert cached_tokens(stack, path, body, "tenant-b") >= 1000
    assert cached_tokens(stack, path, body, None) >= 1000  # and without one, as before


@pytest.mark.parametrize("path", [CHAT, CMPL, GEN])
@pytest.mark.parametrize("salt", ["", "s" * 257, 42, ["a"], None], ids=[
    "empty", "too long", "a number", "a list", "null"])
def test_cache_salt_must_be_a_short_string(stack, path, salt):
    body = {"prompt": "hi", "max_tokens": 1} if path == CMPL else (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1} if path == CHAT
        else {"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    body["cache_salt"] = salt
    resp = post(stack, path, body, AS_USER)
    if salt is None:  # JSON null: no salt
        assert resp.status_code == 200, resp.text
        return
    assert_openai_error(resp, 400, "cache_salt")


def test_books_balance(stack):
    assert_books_balance(stack.url, AS_ADMIN)
