"""Structured outputs and tool calls through the official OpenAI Python client.

Run by tests/structured.rs against a running kvmesh:
    python structured_client.py BASE_URL MODEL
Each check prints `ok <name>`; any failure raises (non-zero exit). Greedy sampling
throughout, so a streamed call can be compared with the same request answered whole.
"""

import json
import re
import sys

import openai
import pydantic

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
MSG = [{"role": "user", "content": "Speak of the weather in Verona."}]


def ok(name):
    print("ok", name, flush=True)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    friendly: bool


# 1. The SDK's parse(): a Pydantic model in, an instance out.
r = client.beta.chat.completions.parse(
    model=model, messages=MSG, response_format=Person, max_tokens=100, temperature=0
)
parsed = r.choices[0].message.parsed
assert isinstance(parsed, Person), r
ok("parse")

# 2. JSON mode: any JSON object.
r = client.chat.completions.create(
    model=model, messages=MSG, response_format={"type": "json_object"}, max_tokens=60,
    temperature=0,
)
text = r.choices[0].message.content
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(text), dict), text
else:
    assert text.startswith("{"), text
ok("json_object")

# 3. A regex and a choice (vLLM's fields, through extra_body), on both endpoints.
r = client.chat.completions.create(
    model=model, messages=MSG, max_tokens=20, temperature=0,
    extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,6} [0-9]{2}"}},
)
assert re.fullmatch("[A-Z][a-z]{2,6} [0-9]{2}", r.choices[0].message.content), r
r = client.completions.create(
    model=model, prompt="ROMEO:", max_tokens=10, temperature=0,
    extra_body={"guided_choice": ["Verona", "Mantua", "Padua"]},
)
assert r.choices[0].text in ("Verona", "Mantua", "Padua"), r
ok("regex_and_choice")

# 4. Tools: required and named calls parse and fit the schema.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class WeatherArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


def check_call(call):
    assert call.type == "function" and call.id, call
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        WeatherArgs(**args)
    else:
        assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET"), call


req = dict(model=model, messages=MSG, tools=[WEATHER, TIME], max_tokens=90, temperature=0)
r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **req)
m = r.choices[0].message
assert r.choices[0].finish_reason == "tool_calls", r
assert m.tool_calls and len(m.tool_calls) == 1, m
for c in m.tool_calls:
    check_call(c)
whole = [(c.function.name, c.function.arguments) for c in m.tool_calls]
ok("tool_choice_required")

r = client.chat.completions.create(
    tool_choice={"type": "function", "function": {"name": "get_time"}}, **req
)
calls = r.choices[0].message.tool_calls
assert calls and all(c.function.name == "get_time" for c in calls), r
for c in calls:
    check_call(c)
ok("tool_choice_named")

# 5. Streaming the same required call reassembles to the same call.
stream = client.chat.completions.create(
    tool_choice="required", parallel_tool_calls=False, stream=True, **req
)
parts, finish = {}, None
for chunk in stream:
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        p = parts.setdefault(tc.index, {"name": None, "args": "", "id": None})
        if tc.id:
            p["id"] = tc.id
        if tc.function and tc.function.name:
            assert p["name"] is None, "a call's name is sent once"
            p["name"] = tc.function.name
        if tc.function and tc.function.arguments:
            p["args"] += tc.function.arguments
    finish = chunk.choices[0].finish_reason or finish
streamed = [(p["name"], p["args"]) for _, p in sorted(parts.items())]
assert finish == "tool_calls", finish
assert streamed == whole, (streamed, whole)
ok("streamed_tool_calls")

# 6. History with an assistant's call and the tool's answer renders and runs.
history = MSG + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Verona\", \"days\": 1}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
]
r = client.chat.completions.create(
    model=model, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
)
assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r
ok("tool_history")

# 7. logit_bias: -100 bans the greedy first token, +100 forces a token.
plain = client.completions.create(
    model=model, prompt="ROMEO:", max_tokens=1, temperature=0,
    extra_body={"return_token_ids": True},
)
first = plain.choices[0].model_extra["token_ids"][0]
banned = client.completions.create(
    model=model, prompt="ROMEO:", max_tokens=1, temperature=0,
    logit_bias={str(first): -100}, extra_body={"return_token_ids": True},
)
assert banned.choices[0].model_extra["token_ids"][0] != first, banned
forced = client.completions.create(
    model=model, prompt="ROMEO:", max_tokens=4, temperature=1.0, seed=3,
    logit_bias={"70": 100}, extra_body={"return_token_ids": True},
)
assert forced.choices[0].model_extra["token_ids"] == [70] * 4, forced
ok("logit_bias")

# 8. Bad input is a 400 that names the field.
for kwargs, field in [
    (dict(logit_bias={"99999999": 5}), "logit_bias"),
    (dict(logit_bias={"5": 300}), "logit_bias"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}], tool_choice="required"), "tools[0].function.parameters"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
]:
    try:
        client.chat.completions.create(model=model, messages=MSG, max_tokens=4, **kwargs)
        raise AssertionError(f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and field in str(e.body), (field, e.body)
ok("bad_input")
print("all ok", flush=True)
