"""Real client libraries against one stack of SmolLM2 (the `make serve` configuration):
openai-agents (its default Responses model and its chat-completions model, with a function
tool), langchain-openai (invoke, stream, with_structured_output), instructor (TOOLS and
JSON_SCHEMA modes) and pydantic-ai (an agent with a tool, structured output).

Their pins clash with ours (and instructor's with openai-agents'), so each runs in a venv of
its own that `make test` builds from tests/clients/requirements-*.txt (.venv-clients/NAME):
a small script per library, run with that venv's python, prints what a user would see as one
JSON line. SmolLM2-135M is weak: the structured replies lean on the grammar (tool_choice
required, json_schema), and the prompts are simple."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Stack

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "clients"
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


@pytest.fixture(scope="module")
def model(stack) -> str:
    import requests

    return requests.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_client(venv: str, script: str, stack, model: str) -> dict:
    python = ROOT / ".venv-clients" / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: `make test` (or `make install`) builds the client "
                    f"venvs from tests/clients/requirements-{venv}.txt")
    proc = subprocess.run([str(python), str(CLIENTS / script), f"{stack.url}/v1", model],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=CLIENTS)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_openai_agents_calls_the_tool_through_responses_and_chat_models(stack, model):
    out = run_client("agents", "agents_client.py", stack, model)
    for kind in ("responses", "chat"):
        assert out[kind]["calls"] == ["Paris"], out
        assert out[kind]["final_output"] == "It is sunny in Paris."


def test_langchain_invoke_stream_and_structured_output(stack, model):
    out = run_client("agents", "langchain_client.py", stack, model)
    assert "Paris" in out["invoke"]
    assert out["stream"] == out["invoke"]  # greedy: the streamed text joins to the same
    assert out["finish_reason"] == "stop"
    assert out["person_type"] == "Person" and out["person"]["name"]
    assert 0 <= out["person"]["age"] <= 120


def test_instructor_tools_and_json_schema_modes_parse_into_the_model(stack, model):
    out = run_client("instructor", "instructor_client.py", stack, model)
    assert set(out) == {"TOOLS", "JSON_SCHEMA"}
    for mode in out.values():
        assert mode["type"] == "Person" and mode["person"]["name"]
        assert 0 <= mode["person"]["age"] <= 120


def test_pydantic_ai_agent_calls_its_tool_and_returns_a_pydantic_model(stack, model):
    out = run_client("agents", "pydantic_ai_client.py", stack, model)
    assert out["calls"] == ["Paris"], out  # parallel_tool_calls off: one call
    assert out["answer"]
    assert out["person_type"] == "Person" and 0 <= out["person"]["age"] <= 120
