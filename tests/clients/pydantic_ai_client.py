"""pydantic-ai: an agent whose tool is called once (tool_choice required on the first step, no
parallel calls), and an agent whose output is a pydantic model."""

from __future__ import annotations

from client_common import WEATHER_QUESTION, Person, report, server
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

base_url, name = server()
model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
settings = {"temperature": 0, "max_tokens": 64, "parallel_tool_calls": False}

calls: list[str] = []


class ToolFirst(AbstractCapability):
    """The tool forced on the run's first step, none after it (the answer then is text): a
    static tool_choice would never let the agent answer; this is pydantic-ai's way."""

    def __init__(self) -> None:
        pass

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "none"}


weather = Agent(model, instructions="Use the tools to answer.", model_settings=settings,
                capabilities=[ToolFirst()])


@weather.tool_plain
def get_weather(city: str) -> str:
    """Get the current weather in a given city."""
    calls.append(city)
    return f"It is sunny in {city}."


answer = weather.run_sync(WEATHER_QUESTION, usage_limits=UsageLimits(request_limit=4))
people = Agent(model, output_type=Person, model_settings=settings)
person = people.run_sync("Describe a person named Alice who is 30 years old.").output
report({"calls": calls, "answer": answer.output, "person_type": type(person).__name__,
        "person": person.model_dump()})
