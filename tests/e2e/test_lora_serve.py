"""A PEFT adapter served by name through `tokenline serve --lora-paths`: /v1/models lists it
under its base, `model` (or /generate's `lora_path`) picks it, an unknown name is a 404 naming
it. /load_lora_adapter and /unload_lora_adapter (admin routes) add and drop one at runtime."""

from __future__ import annotations

import json
import shutil

import aiohttp
import pytest
import torch

from tests.helpers import Stack

PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path = _adapter(tiny_model_dir, root / "pirate", r=8)
    shutil.copytree(path, root / "copy")  # the same weights, to load at runtime
    _adapter(tiny_model_dir, root / "rank32", r=32)  # over --max-lora-rank 16
    with Stack("--model", str(tiny_model_dir), "--lora-paths", f"pirate={path}",
               "--admin-api-key", "admin-secret", timeout=300) as s:
        s.lora_root = root
        yield s


def _adapter(base, path, r: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=[
        "q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # peft starts B at zero: an adapter that changes nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(path))
    return path


async def _post(url: str, path: str, body: dict, headers: dict | None = None
                ) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json=body, headers=headers) as r:
            return r.status, await r.json()


async def test_models_lists_the_adapter_under_its_base(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/v1/models") as r:
            data = (await r.json())["data"]
    base, adapter = data
    assert adapter["id"] == "pirate" and adapter["parent"] == base["id"]


async def test_model_picks_the_adapter_and_changes_the_tokens(stack):
    prompt = "The capital of France is"
    status, base = await _post(stack.url, "/generate", {"text": prompt, "sampling_params": PARAMS})
    assert status == 200, base
    status, by_path = await _post(stack.url, "/generate", {
        "text": prompt, "sampling_params": PARAMS, "lora_path": "pirate"})
    assert status == 200, by_path
    assert by_path["output_ids"] != base["output_ids"]
    status, by_model = await _post(stack.url, "/v1/completions", {
        "model": "pirate", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, by_model
    assert by_model["model"] == "pirate"
    assert by_model["choices"][0]["text"] == by_path["text"]


async def test_unknown_adapter_is_a_404_naming_it(stack):
    status, body = await _post(stack.url, "/v1/completions", {
        "model": "parrot", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and "parrot" in body["error"]["message"], body
    status, body = await _post(stack.url, "/generate", {"text": "hi", "lora_path": "parrot"})
    assert status == 404 and "parrot" in body["error"]["message"], body


async def test_every_generation_route_takes_the_adapter(stack):
    messages = [{"role": "user", "content": "Hello"}]
    status, chat = await _post(stack.url, "/v1/chat/completions", {
        "model": "pirate", "messages": messages, "max_tokens": 4})
    assert status == 200 and chat["model"] == "pirate", chat
    status, msg = await _post(stack.url, "/v1/messages", {
        "model": "pirate", "messages": messages, "max_tokens": 4})
    assert status == 200 and msg["model"] == "pirate", msg
    status, resp = await _post(stack.url, "/v1/responses", {
        "model": "pirate", "input": "Hello", "max_output_tokens": 4})
    assert status == 200 and resp["model"] == "pirate", resp


def _completion(model: str, n: int, stream: bool = False) -> dict:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def _stream_text(http: aiohttp.ClientSession, url: str, body: dict, while_first):
    """A streamed completion's text; `while_first()` runs once its first chunk is in."""
    text, called = "", False
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                if not called:
                    called = True
                    await while_first()
    return text


async def _model_ids(url: str) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as r:
            return [m["id"] for m in (await r.json())["data"]]


async def test_a_bad_load_is_a_400_naming_it_and_a_running_stream_keeps_its_tokens(stack):
    root = stack.lora_root
    status, whole = await _post(stack.url, "/v1/completions", _completion("pirate", 64))
    assert status == 200, whole
    refusals = []

    async def bad_loads() -> None:
        for body, why in (
                ({"lora_name": "big", "lora_path": str(root / "rank32")},
                 "rank 32 exceeds --max-lora-rank 16"),
                ({"lora_name": "none", "lora_path": str(root / "nowhere")},
                 "nowhere: no such directory"),
                ({"lora_name": "pirate", "lora_path": str(root / "copy")}, "already loaded"),
                ({"lora_name": "nopath"}, "lora_path")):
            refusals.append((await _post(stack.url, "/load_lora_adapter", body, ADMIN), why))

    async with aiohttp.ClientSession() as http:
        text = await _stream_text(http, stack.url, _completion("pirate", 64, True), bad_loads)
    assert text == whole["choices"][0]["text"]
    for (status, body), why in refusals:
        assert status == 400 and why in body["error"]["message"], (why, body)
    assert refusals[0][0][1]["error"]["param"] == "lora_path"
    assert await _model_ids(stack.url) == [await _base(stack.url), "pirate"]


async def _base(url: str) -> str:
    return (await _model_ids(url))[0]


async def test_an_adapter_loaded_at_runtime_serves_and_unloads_after_its_requests(stack):
    body = {"lora_name": "pirate2", "lora_path": str(stack.lora_root / "copy")}
    status, out = await _post(stack.url, "/load_lora_adapter", body)
    assert status == 401, out  # an admin route
    status, out = await _post(stack.url, "/load_lora_adapter", body, ADMIN)
    assert status == 200 and set(out["loaded_adapters"]) == {"pirate", "pirate2"}, out
    assert "pirate2" in await _model_ids(stack.url)
    _, by_start = await _post(stack.url, "/v1/completions", _completion("pirate", 200))
    _, base = await _post(stack.url, "/v1/completions", _completion(await _base(stack.url), 8))
    unload = {}

    async def unload_it() -> None:  # while a request under it runs
        unload["reply"] = await _post(stack.url, "/unload_lora_adapter", {"lora_name": "pirate2"},
                                      ADMIN)
        unload["after"] = await _post(stack.url, "/v1/completions", _completion("pirate2", 4))

    async with aiohttp.ClientSession() as http:
        text = await _stream_text(http, stack.url, _completion("pirate2", 200, True), unload_it)
    assert text == by_start["choices"][0]["text"]  # the same weights, and it ran to its end
    assert by_start["choices"][0]["text"][:8] != base["choices"][0]["text"][:8]
    status, out = unload["reply"]
    assert status == 200 and "pirate2" not in out["loaded_adapters"], out
    assert "unloading" in out["message"] and "1 running request" in out["message"], out
    status, after = unload["after"]
    assert status == 404 and "pirate2" in after["error"]["message"], after
    assert "pirate2" not in await _model_ids(stack.url)
    status, again = await _post(stack.url, "/unload_lora_adapter", {"lora_name": "pirate2"},
                                ADMIN)
    assert status == 404 and "pirate2" in again["error"]["message"], again
