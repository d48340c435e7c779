"""A PEFT adapter served by name through `tokenline serve --lora-paths`: /v1/models lists it
under its base, `model` (or /generate's `lora_path`) picks it, an unknown name is a 404 naming
it."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from tests.helpers import Stack

PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # peft starts B at zero: an adapter that changes nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    path = tmp_path_factory.mktemp("lora") / "pirate"
    model.save_pretrained(str(path))
    with Stack("--model", str(tiny_model_dir), "--lora-paths", f"pirate={path}",
               timeout=300) as s:
        yield s


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json=body) as r:
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
