"""The official `openai` client against a layerstream stack (tests/http.rs runs it).

Usage: openai_client.py BASE_URL API_KEY PROMPT TOKEN_IDS(comma-separated)
Prints one JSON object with what the client saw; the Rust test compares it with `layerstream run`
and with log-softmax of the CPU backend's logits.
"""
import json
import sys

import openai

base, key, prompt, ids = sys.argv[1], sys.argv[2], sys.argv[3], [int(x) for x in sys.argv[4].split(",")]
client = openai.OpenAI(base_url=base + "/v1", api_key=key)
out = {}

models = client.models.list()
out["models"] = [m.id for m in models.data]
model = out["models"][0]
msgs = [{"role": "user", "content": prompt}]

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
out["chat"] = {
    "text": r.choices[0].message.content,
    "role": r.choices[0].message.role,
    "finish_reason": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
    "object": r.object,
}

chunks, text, usage, finish = 0, "", None, None
stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
    stream_options={"include_usage": True})
for c in stream:
    chunks += 1
    if c.usage is not None:
        usage = c.usage.model_dump()
    for ch in c.choices:
        text += ch.delta.content or ""
        finish = ch.finish_reason or finish
out["stream"] = {"text": text, "chunks": chunks, "usage": usage, "finish_reason": finish}

r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, logprobs=3)
lp = r.choices[0].logprobs
out["completion"] = {
    "text": r.choices[0].text,
    "tokens": lp.tokens,
    "token_logprobs": lp.token_logprobs,
    "top_logprobs": lp.top_logprobs,
    "usage": r.usage.model_dump(),
}

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0,
                                   logprobs=True, top_logprobs=2)
out["chat_logprobs"] = [
    {"token": c.token, "logprob": c.logprob, "top": [[t.token, t.logprob] for t in c.top_logprobs]}
    for c in r.choices[0].logprobs.content
]

# A stop string taken from the greedy answer: the text ends before it.
answer = out["chat"]["text"]
stop = answer[len(answer) // 2:][:3] if len(answer) > 4 else None
if stop and stop.strip():
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stop=[stop])
    out["stop"] = {"stop": stop, "text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}

# Seeded sampling repeats itself.
a = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0.9, seed=7)
b = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0.9, seed=7)
out["seeded_equal"] = a.choices[0].message.content == b.choices[0].message.content


def status_of(call):
    try:
        call()
        return 200
    except openai.APIStatusError as e:
        return e.status_code


bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key")
out["errors"] = {
    "wrong_key": status_of(lambda: bad.models.list()),
    "unknown_model": status_of(lambda: client.chat.completions.create(model="no-such-model", messages=msgs)),
    "too_long": status_of(lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=10**6)),
    "n17": status_of(lambda: client.chat.completions.create(model=model, messages=msgs, n=17)),
    "top_logprobs_21": status_of(lambda: client.chat.completions.create(
        model=model, messages=msgs, logprobs=True, top_logprobs=21)),
}
print(json.dumps(out))
