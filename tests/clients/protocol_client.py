"""What agent frameworks rely on in the OpenAI protocol, through the official `openai` client
(tests/frameworks.rs runs it on a real stack serving SmolLM2): tools beside a response format,
tool_choice's call counts, a call cut by max_tokens, batched completion prompts, vLLM's
continuous_usage_stats, the parameter policy and text_offset.

Usage: protocol_client.py BASE_URL
Prints one JSON object with what it saw; the Rust test asserts on it.
"""
import json
import sys

from typing import Literal

import jsonschema
import openai
import pydantic

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
model = client.models.list().data[0].id
out = {}

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}},
          "required": ["answer"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": CITY}},
         {"type": "function", "function": {"name": "City", "parameters": CITY}}]
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]


def calls_of(r):
    return [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]


# Tools and a response format together under auto: each answer is a call of a tool with valid
# arguments, or text valid under the format (never markup, never a 400); streamed and not.
def streamed_answer(**kw):
    """A streamed chat's text, calls and finish reason."""
    content, names, args, fin = "", {}, {}, None
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            fin = ch.finish_reason or fin
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                names[tc.index] = tc.function.name or names.get(tc.index)
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    return content or None, [(names[i], args[i]) for i in sorted(args)], fin


seen = []
for seed in range(6):
    kw = dict(model=model, messages=msgs, tools=TOOLS, max_tokens=64, temperature=1.0, seed=seed,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    if seed % 2:
        content, calls, fin = streamed_answer(**kw)
    else:
        r = client.chat.completions.create(**kw)
        content, calls, fin = r.choices[0].message.content, calls_of(r), r.choices[0].finish_reason
    try:
        if calls:
            for name, args in calls:
                assert name in ("get_weather", "City"), name
                jsonschema.validate(json.loads(args), CITY)
            kind = "call"
        else:
            jsonschema.validate(json.loads(content), ANSWER)
            kind = "text"
        seen.append({"kind": kind, "finish": fin, "stream": seed % 2 == 1, "ok": True})
    except Exception as e:  # noqa: BLE001 - reported
        seen.append({"kind": "bad", "content": content, "calls": calls, "error": str(e)[:200], "ok": False})
out["tools_with_format"] = seen

# tool_choice: a named function is called exactly once; required with parallel_tool_calls false
# once; auto with it false at most once.
counts = {"named": [], "required_single": [], "auto_single": []}
for seed in range(4):
    for case, kw in [("named", {"tool_choice": {"type": "function", "function": {"name": "City"}}}),
                     ("required_single", {"tool_choice": "required", "parallel_tool_calls": False}),
                     ("auto_single", {"tool_choice": "auto", "parallel_tool_calls": False})]:
        r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=80,
                                           temperature=1.0, seed=seed, **kw)
        calls = calls_of(r)
        counts[case].append({"calls": len(calls), "names": [c[0] for c in calls],
                             "finish": r.choices[0].finish_reason,
                             "markup": "<tool_call>" in (r.choices[0].message.content or "")})
out["tool_choice"] = counts

# A forced call cut by max_tokens: tool_calls with the arguments so far, finish length, no markup.
# The whole call first (greedy), then shorter limits until one cuts it inside its arguments.
forced = {"type": "function", "function": {"name": "get_weather"}}
r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=64, temperature=0,
                                   tool_choice=forced)
cut_at = None
for m in range(r.usage.completion_tokens - 1, 0, -1):
    (name, args), = calls_of(client.chat.completions.create(
        model=model, messages=msgs, tools=TOOLS, max_tokens=m, temperature=0, tool_choice=forced)) or [(None, "")]
    try:
        json.loads(args)
    except ValueError:
        if name:
            cut_at = m
            break
cut = {"cut_at": cut_at, "whole_call": calls_of(r)}
for stream in (False, True):
    kw = dict(model=model, messages=msgs, tools=TOOLS, max_tokens=cut_at, temperature=0, tool_choice=forced)
    if stream:
        name, args, content, fin = None, "", "", None
        for c in client.chat.completions.create(stream=True, **kw):
            for ch in c.choices:
                fin = ch.finish_reason or fin
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    name = tc.function.name or name
                    args += tc.function.arguments or ""
    else:
        r = client.chat.completions.create(**kw)
        (name, args), = calls_of(r) or [(None, "")]
        content, fin = r.choices[0].message.content or "", r.choices[0].finish_reason
    cut["stream" if stream else "whole"] = {"name": name, "arguments": args, "content": content, "finish": fin}
out["cut"] = cut

# Batched prompts: each prompt's n choices at index prompt*n + choice, each equal to the single
# request (greedy), the prompts' tokens summed in usage; streamed the same.
prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=6, temperature=0)
singles = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
streamed = {}
for c in client.completions.create(model=model, prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True):
    for ch in c.choices:
        streamed[ch.index] = streamed.get(ch.index, "") + ch.text
echoed = client.completions.create(model=model, prompt=prompts, max_tokens=0, echo=True, logprobs=0,
                                   temperature=0)
out["batch"] = {
    "echo": [c.text for c in sorted(echoed.choices, key=lambda c: c.index)],
    "echo_scores": [len(c.logprobs.token_logprobs) for c in sorted(echoed.choices, key=lambda c: c.index)],
    "indexes": sorted(c.index for c in r.choices),
    "texts": [c.text for c in sorted(r.choices, key=lambda c: c.index)],
    "singles": [s.choices[0].text for s in singles],
    "prompt_tokens": r.usage.prompt_tokens,
    "single_prompt_tokens": [s.usage.prompt_tokens for s in singles],
    "streamed": [streamed.get(i) for i in range(6)],
}

# continuous_usage_stats: every chunk carries the usage so far.
usage = []
for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                   stream=True, stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True}):
    usage.append(c.usage.completion_tokens if c.usage else None)
out["continuous_usage"] = usage

# The parameter policy: an unknown one is ignored and named; one that changes the output is refused.
raw = client.chat.completions.with_raw_response.create(
    model=model, messages=msgs, max_tokens=2, extra_body={"x_unknown": 1, "user": "u"})
out["ignored_header"] = raw.headers.get("x-layerstream-ignored")
try:
    client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={"min_p": 0.2})
    out["min_p"] = "accepted"
except openai.BadRequestError as e:
    out["min_p"] = e.body.get("param") if isinstance(e.body, dict) else str(e.body)

# text_offset counts the text returned: special tokens (forced here) are not part of it.
r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=1,
                              logit_bias={"0": 100}, extra_body={"ignore_eos": True})
lp = r.choices[0].logprobs
out["offsets"] = {"text": r.choices[0].text, "text_offset": lp.text_offset, "tokens": lp.tokens}
# The client's own structured-output helper: a pydantic model as the response format, parsed back.
class Town(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: Literal["France", "Italy", "Spain"]


parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
p = parse(model=model, messages=[{"role": "user", "content": "Where is the Eiffel tower?"}],
          response_format=Town, max_tokens=64, temperature=0)
parsed = p.choices[0].message.parsed
out["parse"] = parsed.model_dump() if isinstance(parsed, Town) else None
print(json.dumps(out))
