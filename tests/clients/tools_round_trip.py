"""A tool round trip through the official `openai` client (tests/agents.rs runs it): a required
call, the tool's answer sent back in the history, then an answer with tools shown but not
called, streamed. Prints what the client saw as JSON.

Usage: tools_round_trip.py BASE_URL
"""
import json
import sys

import jsonschema
import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = client.models.list().data[0].id
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"], "additionalProperties": False}}}]
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
out = {}
r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=64,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   parallel_tool_calls=False, temperature=0)
m = r.choices[0].message
calls = m.tool_calls or []
out["first"] = {"finish": r.choices[0].finish_reason, "calls": [c.function.name for c in calls],
                "content": m.content}
ok = len(calls) == 1
if ok:
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
history = msgs + [m.model_dump(exclude_none=True)] + [
    {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": json.dumps({"temp_c": 21})}
    for c in calls]
text, finish = "", None
for c in client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=12, temperature=0, stream=True):
    for ch in c.choices:
        text += ch.delta.content or ""
        finish = ch.finish_reason or finish
out["final"] = {"text": text, "finish": finish, "valid_call": ok}
print(json.dumps(out))
