"""Structured output and tool calls end to end, with the official `openai` client against
`python -m gateway --http-port` in front of two real tiny-hybrid workers (random weights: only
the grammar's mask makes their output valid). The checkpoint's chat template is a Hermes-style
one with tools (tests/data/hermes_tool_template.jinja), so the gateway picks the Hermes parser.

Shown: a json_schema response that parses and validates 20 times out of 20 at temperature 1;
regex and choice (chat and completions); bad schemas and regexes are 400s naming the field;
`tool_choice` required and named give tool calls whose arguments validate against the tool's
parameters, whole and streamed (id and name first, then argument fragments, finish_reason
"tool_calls"); `auto` parses Hermes `<tool_call>` blocks (the output forced into one by a
grammar); a conversation with tool-role messages renders through the template."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.gateway.conftest import chat_checkpoint
from tests.gateway.live_stack import LiveStacks

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "hermes_tool_template.jinja"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MODEL = "tiny-hybrid-tools"  # the checkpoint directory's name
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# `required` lets the schema's array of calls grow without bound: random weights at temperature
# 1 may keep appending valid calls until max_tokens (finish "length"), by the luck of the draws.
# parallel_tool_calls false bounds it to one call (maxItems 1), so every choice completes.
ONE_CALL = {"parallel_tool_calls": False}


def tools_checkpoint(root: Path) -> str:
    """The chat checkpoint (tests/gateway/conftest.py) with the Hermes tool template, and the
    tokenizer's special ids in config.json (the preset's are the byte tokenizer's: its EOS 258
    is a byte token of this vocabulary, so a grammar that ends at EOS would end at a byte)."""
    path = root / "tiny-hybrid-tools"
    if not (path / "config.json").is_file():
        base = Path(chat_checkpoint(root))
        shutil.copytree(base, path, dirs_exist_ok=True)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATE.read_text()
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        model = json.loads((path / "config.json").read_text())
        model.update(bos_token_id=0, pad_token_id=1, eos_token_id=3)  # <|im_end|>
        (path / "config.json").write_text(json.dumps(model))
    return str(path)


@pytest.fixture(scope="module")
def client():
    stacks = LiveStacks(model=tools_checkpoint, gateway_args=("--tokenizer", "{model}"))
    try:
        stack = stacks.get()
        with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="tok-a", max_retries=0,
                           timeout=120) as c:
            yield c
    finally:
        stacks.close()


def test_json_schema_validates_20_of_20_at_temperature_1(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    outputs = []
    for seed in (1, 2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                           temperature=1.0, max_tokens=120, n=10, seed=seed)
        outputs += [(c.finish_reason, c.message.content) for c in r.choices]
    assert len(outputs) == 20
    for finish, content in outputs:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)


def test_json_object_regex_and_choice_chat_and_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=3,
                                       max_tokens=40, extra_body={"structured_outputs": {
                                           "regex": r"[A-Z][a-z]{2,5}-[0-9]{2}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="Pick one:", temperature=1.0, seed=4,
                                  max_tokens=20, n=4, extra_body={"structured_outputs": {
                                      "choice": ["red", "green", "blue sky"]}})
    assert all(c.text in ("red", "green", "blue sky") for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=5,
                                       max_tokens=200, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "([a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 5}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),  # vLLM's field for a tool not in `tools` (tests/gateway/test_http_requests_vllm.py)
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                       extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_give_valid_calls(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, seed=7, max_tokens=120, n=3,
                                       **ONE_CALL)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_streamed_tool_calls_arrive_as_openai_streams_them(client, choice):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice=choice, temperature=1.0, seed=8,
                                            max_tokens=120, stream=True, **ONE_CALL)
    calls: dict[int, dict] = {}
    fragments = 0
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.id is not None:  # a call opens with its id, type and name
                    assert d.index not in calls and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                elif d.function.arguments:
                    fragments += 1
                calls[d.index]["args"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls and fragments >= 1
    if isinstance(choice, dict):
        assert fragments > 1  # a named call streams its arguments as they are generated
    for call in calls.values():
        jsonschema.validate(json.loads(call["args"]), PARAMS[call["name"]])


HERMES = ('root ::= "Let me check. <tool_call>{\\"name\\": \\"get_weather\\", '
          '\\"arguments\\": {\\"city\\": \\"" city "\\", \\"unit\\": \\"C\\"}}</tool_call>"\n'
          'city ::= "Paris" | "Oslo"')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_tool_call_blocks(client, stream):
    """`auto` with the Hermes parser: the output (forced by a grammar into a Hermes block, as a
    trained model writes it) becomes content before the block and one tool call."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=9,
                  max_tokens=200, extra_body={"structured_outputs": {"grammar": HERMES}})
    if not stream:
        c = client.chat.completions.create(**kwargs).choices[0]
        content, finish = c.message.content, c.finish_reason
        name, args = c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments
    else:
        content, name, args, finish = "", None, "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                content += c.delta.content or ""
                for d in c.delta.tool_calls or ():
                    name = d.function.name or name
                    args += d.function.arguments or ""
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert name == "get_weather" and json.loads(args)["city"] in ("Paris", "Oslo")


def test_a_tool_conversation_renders_through_the_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 60  # the tools and the calls were rendered


def test_json_schema_with_logprobs_gives_valid_json_and_each_tokens_logprobs(client):
    """Both features together: the grammar's mask decides the tokens, the logprobs are still the
    model's own (read before the mask), one entry per output token, each with its top 2."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                       temperature=1.0, seed=7, max_tokens=120, logprobs=True,
                                       top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens > 0
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-5
