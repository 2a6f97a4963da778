"""What an agent asks of an OpenAI-compatible server, through the official `openai` client
(tests/agents.rs runs it on a real stack): JSON-schema outputs validated with `jsonschema`, required
tool calls validated against the function's schema (streamed and not), a tool round trip, `n` with a
seed against single requests, the penalties and logit_bias, and echo with prompt log-probabilities.

Usage: agents_client.py BASE_URL SAMPLES
Prints one JSON object with what it saw; failures are counted, not raised, so the Rust test can say
which case failed.
"""
import json
import sys

import jsonschema
import openai

base, samples = sys.argv[1], int(sys.argv[2])
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
model = client.models.list().data[0].id
out = {}

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "country": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["n"], "additionalProperties": False}, "minItems": 1, "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["note"], "additionalProperties": False},
    {"type": "object", "properties": {"first": {"type": "string", "maxLength": 8}, "last": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["first", "last", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}}, "required": ["flags"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 6}}, "required": ["kind", "name"], "additionalProperties": False},
]
valid = 0
failures = []
for i, schema in enumerate(SCHEMAS):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Answer in JSON about Paris."}],
        max_tokens=96, temperature=0.7, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), schema)
        valid += 1
    except Exception as e:  # noqa: BLE001 - counted and reported
        failures.append({"schema": i, "text": text, "error": str(e)[:200]})
out["json_schema"] = {"valid": valid, "total": len(SCHEMAS), "failures": failures}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": WEATHER}}]
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
calls_valid, calls_total, finish, bad = 0, 0, set(), []
for seed in range(samples):
    stream = seed % 2 == 1
    kw = dict(model=model, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=96,
              temperature=1.0, seed=seed)
    if stream:
        args, name, fin = {}, {}, None
        for c in client.chat.completions.create(stream=True, **kw):
            for ch in c.choices:
                fin = ch.finish_reason or fin
                for tc in ch.delta.tool_calls or []:
                    if tc.function.name:
                        name[tc.index] = tc.function.name
                    args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        calls = [(name.get(i), args[i]) for i in sorted(args)]
    else:
        r = client.chat.completions.create(**kw)
        fin = r.choices[0].finish_reason
        calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
    finish.add(fin)
    calls_total += 1
    # Cut by max_tokens (the tiny model may repeat calls): the last call's arguments are cut too.
    complete = calls[:-1] if fin == "length" else calls
    try:
        assert complete, "no complete tool call"
        for n, a in complete:
            assert n == "get_weather", n
            jsonschema.validate(json.loads(a), WEATHER)
        calls_valid += 1
    except Exception as e:  # noqa: BLE001
        bad.append({"seed": seed, "stream": stream, "calls": calls, "error": str(e)[:200]})
out["required"] = {"valid": calls_valid, "total": calls_total, "finish": sorted(map(str, finish)), "bad": bad[:3]}

# A round trip: the call, the tool's answer, the final answer (no tools forced).
r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                   max_tokens=96, temperature=0)
call = r.choices[0].message.tool_calls[0]
history = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
r2 = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                    max_tokens=24, temperature=0)
out["round_trip"] = {"call": call.function.name, "id": call.id,
                     "final": r2.choices[0].message.content, "finish": r2.choices[0].finish_reason}

# n with a seed: each choice equals a single request with that choice's seed.
r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                              seed=100, n=4)
singles = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                     temperature=1.0, seed=100 + i).choices[0].text for i in range(4)]
out["n"] = {"choices": [c.text for c in sorted(r.choices, key=lambda c: c.index)], "singles": singles,
            "completion_tokens": r.usage.completion_tokens, "prompt_tokens": r.usage.prompt_tokens}

# Penalties and logit_bias change the output; a ban keeps a token out.
plain = client.completions.create(model=model, prompt="The the the the", max_tokens=16, temperature=0)
pen = client.completions.create(model=model, prompt="The the the the", max_tokens=16, temperature=0,
                                frequency_penalty=2.0, presence_penalty=2.0)
out["penalties"] = {"plain": plain.choices[0].text, "penalized": pen.choices[0].text}

# echo + logprobs with max_tokens 0: the prompt's log-probabilities (lm-evaluation-harness's way).
r = client.completions.create(model=model, prompt="The capital of France is Paris", max_tokens=0,
                              echo=True, logprobs=1, temperature=0)
lp = r.choices[0].logprobs
out["echo"] = {"text": r.choices[0].text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
               "completion_tokens": r.usage.completion_tokens}
print(json.dumps(out))
