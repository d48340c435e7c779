"""openai-agents: an agent with a function tool, through its default model (the Responses API)
and through its chat-completions model. The tool is forced on the first turn (tool_choice
required) and its output is the run's result, so the run is one model call and one tool call."""

from __future__ import annotations

import asyncio

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from client_common import WEATHER_QUESTION, report, server
from openai import AsyncOpenAI

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a given city."""
    calls.append(city)
    return f"It is sunny in {city}."


async def run(model) -> dict:
    calls.clear()
    agent = Agent(name="weather", instructions="Use the tools to answer.", model=model,
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=64))
    result = await Runner.run(agent, WEATHER_QUESTION, max_turns=2)
    return {"calls": list(calls), "final_output": result.final_output}


async def main() -> None:
    base_url, name = server()
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    report({"responses": await run(OpenAIResponsesModel(model=name, openai_client=client)),
            "chat": await run(OpenAIChatCompletionsModel(model=name, openai_client=client))})


asyncio.run(main())
