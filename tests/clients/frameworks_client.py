"""Agent frameworks, unchanged, against layerstream's OpenAI API (tests/agents.rs runs each on a real
stack serving SmolLM2): a function tool and a structured output through each framework's own way of
asking. Each case asserts the protocol outcome (the tool ran, the output validates, no error), not the
tiny model's wisdom: schemas are bounded and tool_choice set so that the default model can succeed.

Usage: frameworks_client.py BASE_URL FRAMEWORK
FRAMEWORK: openai-agents | pydantic-ai | instructor | langchain | smolagents
Prints one JSON object; exits 3 when the framework's package is not installed.
"""
import asyncio
import json
import os
import sys
from typing import Literal

import pydantic

base, which = sys.argv[1], sys.argv[2]
os.environ.setdefault("OPENAI_API_KEY", "none")
os.environ.setdefault("OPENAI_BASE_URL", base + "/v1")


class City(pydantic.BaseModel):
    """A city and its country."""
    city: str = pydantic.Field(max_length=12)
    country: Literal["France", "Italy", "Spain"]


ran = []


def get_weather(city: str) -> str:
    """The current weather in a city."""
    ran.append(city)
    return json.dumps({"city": city, "temp_c": 21})


def model_id():
    import openai
    return openai.OpenAI().models.list().data[0].id


def openai_agents():
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=model_id(), openai_client=AsyncOpenAI())
    # The first turn must call the tool; after it tool_choice resets to auto (the SDK's default)
    # and the tool is disabled (the tiny model would call it again), so the answer is text in the
    # output type's schema.
    tool = function_tool(get_weather, is_enabled=lambda ctx, agent: not ran)
    agent = Agent(name="weather", instructions="Answer with the city.", model=model,
                  tools=[tool], output_type=City,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                               temperature=0, max_tokens=96))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)
    out = result.final_output
    return {"tool_ran": len(ran), "output": out.model_dump(), "valid": isinstance(out, City)}


def pydantic_ai():
    from pydantic_ai import Agent, NativeOutput, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    model = OpenAIChatModel(model_id(), provider=OpenAIProvider(base_url=base + "/v1", api_key="none"))
    async def once(ctx, tool_def):
        # Offered until it ran (the tiny model would call it again and again).
        return None if ran else tool_def

    agent = Agent(model, output_type=NativeOutput(City), tools=[Tool(get_weather, prepare=once)],
                  model_settings=ModelSettings(temperature=0, max_tokens=96, parallel_tool_calls=False))
    r = agent.run_sync("What is the weather in Paris?")
    return {"tool_ran": len(ran), "output": r.output.model_dump(), "valid": isinstance(r.output, City)}


def instructor_modes():
    import instructor
    import openai
    out = {}
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(), mode=mode)
        c = client.chat.completions.create(model=model_id(), response_model=City, max_tokens=96,
                                           temperature=0, max_retries=0,
                                           messages=[{"role": "user", "content": "Where is the Eiffel tower?"}])
        out[mode.value] = {"output": c.model_dump(), "valid": isinstance(c, City)}
    return out


def langchain():
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=model_id(), temperature=0, max_tokens=96, base_url=base + "/v1", api_key="none")
    out = {}
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    out["bind_tools"] = {"calls": [c["name"] for c in ai.tool_calls],
                         "args_valid": all(isinstance(c["args"].get("city"), str) for c in ai.tool_calls)}
    for method in ("function_calling", "json_schema"):
        c = llm.with_structured_output(City, method=method).invoke("Where is the Eiffel tower?")
        out[method] = {"output": c.model_dump() if c else None, "valid": isinstance(c, City)}
    return out


def smolagents_tool():
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: The city's name.
        """
        return get_weather(city)

    model = OpenAIServerModel(model_id=model_id(), api_base=base + "/v1", api_key="none",
                              temperature=0, max_tokens=96, parallel_tool_calls=False)
    def after(step, agent):
        # Once the tool ran only final_answer is left (the tiny model would call it again).
        if ran:
            agent.tools.pop("weather", None)

    agent = ToolCallingAgent(tools=[weather], model=model, max_steps=3, verbosity_level=0,
                             step_callbacks=[after])
    answer = agent.run("What is the weather in Paris? Call weather, then give the final answer.")
    return {"tool_ran": len(ran), "answer": str(answer)}


CASES = {"openai-agents": ("agents", openai_agents), "pydantic-ai": ("pydantic_ai", pydantic_ai),
         "instructor": ("instructor", instructor_modes), "langchain": ("langchain_openai", langchain),
         "smolagents": ("smolagents", smolagents_tool)}
package, run = CASES[which]
try:
    __import__(package)
except ImportError as e:
    print(f"{which}: not installed ({e})", file=sys.stderr)
    sys.exit(3)
print(json.dumps(run()))
