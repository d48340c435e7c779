"""What the client scripts share (they run in the clients' venvs, with none of our packages):
the server's address from argv, the tool and the model they all use, and one JSON line out."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel, Field

QUESTION = "What is the capital of France?"
WEATHER_QUESTION = "What is the weather like in Paris?"
SYSTEM = "You are a helpful assistant. Answer in one sentence."


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def server() -> tuple[str, str]:
    """(base URL ending in /v1, model name) from the command line."""
    return sys.argv[1], sys.argv[2]


def report(result: dict) -> None:
    print(json.dumps(result))
