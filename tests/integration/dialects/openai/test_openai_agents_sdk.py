"""The `openai-agents` SDK, unchanged, running one agent with one function tool against the package's
shared server (conftest.py) over /v1/responses: the model (SmolLM2, greedy, `llama-json`) is made to
call the tool on its first turn, the SDK runs it and sends the call and its output back, and the model
answers. The tool is enabled until it has been called once (the SDK's `is_enabled`): a 135M model left
free to call it again does so turn after turn."""

from __future__ import annotations

import asyncio

import pytest

from tiny_store import TOOL_PARSER as MODEL

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server


def test_an_agent_calls_its_tool_and_answers(server, openai_client):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no traces exported to OpenAI
    asked: list[str] = []

    @function_tool(is_enabled=lambda context, agent: not asked)
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return f"It is sunny and 21 C in {city}."

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai_client(server, asynchronous=True))
    # `required` makes the first turn a call; the SDK then resets tool_choice (and the tool is off by then).
    agent = Agent(name="weather", instructions="Answer questions about the weather briefly.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=24))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert asked and asked[0] in ("Paris", "paris")
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs[0].output == f"It is sunny and 21 C in {asked[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # the call, then the answer
