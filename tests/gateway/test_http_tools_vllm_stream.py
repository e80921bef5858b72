"""Our streamed `auto` tool calls (Hermes blocks) against vLLM 0.33.0's streaming Hermes parser
(`Hermes2ProToolParser.extract_tool_calls_streaming`, copied verbatim from the wheel into
tests/data/vllm_tools_v0_33_0.py): the same text deltas fed to both, the deltas each sends
assembled as a client assembles them, and the results compared.

Ours is the gateway's streaming path of a chat choice (gateway/http/choices.py's
`Choices.chunks`, through its ToolStream). vLLM's parser is called as its serving layer calls it
(`previous_text`, `current_text`, `delta_text`); the adapter is the smallest that runs it: the
tokenizer it is given is a bare object (it only checks that one was given), and the token ids
are empty lists (it never reads them). After the last delta vLLM's serving layer appends
`get_remaining_unstreamed_args()` to the last call, which for this parser is always empty
(checked).

What the comparison shows (docs/structured_output.md, "Tools"):
- content before `<tool_call>` streams alike, delta for delta, both holding back a tail that
  could be the tag's start;
- vLLM streams each call's name as soon as it is complete and its arguments as they come, as
  the model wrote them; we send the calls when the output ends, arguments re-serialized (the
  same JSON value: a compact `{"x":1}` is `{"x": 1}` from us);
- where a block is not a well-formed call (or, once, where it is), vLLM's streaming parser
  departs from its own non-streaming parser, ours does not: it streams what that parser returns
  (`DIFFERENT` below says what vLLM streams).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.http import tools
from gateway.http.choices import Choices
from tests.data import vllm_tools_v0_33_0 as vllm

TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "hermes_tool_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("f", "get_weather", "noop")]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _tokens(text: str) -> list[str]:
    """As a tokenizer with the tags as special tokens would give them: each tag one delta, the
    rest in pieces of 5 characters."""
    out: list[str] = []
    for part in re.split(r"(</?tool_call>)", text):
        out += [part] if part.startswith(("<tool_call>", "</tool_call>")) else _pieces(part, 5)
    return [p for p in out if p]


CHUNKINGS = {"1 char": lambda t: _pieces(t, 1), "3 chars": lambda t: _pieces(t, 3),
             "tags whole": _tokens, "all at once": lambda t: [t]}


def vllm_steps(deltas: list[str]) -> list[list[dict]]:
    """The delta vLLM's streaming Hermes parser sends for each text delta ([] for none); the
    last one completed by the serving layer (DelegatingParser._append_unstreamed_tool_args)."""
    parser = vllm.Hermes2ProToolParser(object())
    previous, steps = "", []
    for i, delta in enumerate(deltas):
        current = previous + delta
        message = parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], None)
        if i == len(deltas) - 1:  # the output's end
            vllm.DelegatingParser._append_unstreamed_tool_args(
                SimpleNamespace(_tool_parser=parser), message)
        steps.append([] if message is None else [message.model_dump(exclude_none=True)])
        previous = current
    return steps


def our_steps(deltas: list[str]) -> list[list[dict]]:
    """The deltas our gateway streams for each text delta, and one more step: the output's end
    (a stop)."""
    choices = Choices(chat=True, tool_plan=tools.plan(TOOLS, "auto", None, TEMPLATE))
    assert choices.tool_plan.parser == "hermes"
    sample = SimpleNamespace(index=0, finish=None, fresh=[])
    steps = [[c["delta"] for c in choices.chunks(sample, d, False)] for d in deltas]
    sample.finish = "stop"
    steps.append([c["delta"] for c in choices.chunks(sample, "", True)])
    return steps


def assemble(steps: list[list[dict]]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client assembles the deltas."""
    content, calls = None, {}
    for delta in (d for step in steps for d in step):
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            fn = call.get("function") or {}
            entry["name"] = fn.get("name") or entry["name"]
            entry["arguments"] += fn.get("arguments") or ""
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def vllm_whole(output: str) -> tuple[str | None, list[tuple[str, str]]]:
    """vLLM's non-streaming Hermes parser on the whole output."""
    info = vllm.Hermes2ProToolParser(object()).extract_tool_calls(output, None)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


TWO_CALLS = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
             '</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>')
# the same assembled result from both, text for text
SAME = {
    "no call": "no call at all, just text < and <tool in it.",
    "two calls": TWO_CALLS,
    "text after the calls": 'Text <tool_call>{"name": "f", "arguments": {"k": [1, 2]}}'
                            "</tool_call> and after",
    "space before": '  <tool_call>{"name": "f", "arguments": {"x": "é"}}</tool_call>',
    "unclosed, whole": '<tool_call>{"name": "f", "arguments": {"x": "é"}}',
    "arguments a string": '<tool_call>{"name": "f", "arguments": "already text"}</tool_call>',
}
# the same content and names; the arguments the same JSON value, written differently
SAME_JSON = {
    "compact": '<tool_call>{"name":"f","arguments":{"x":1,"y":[true,null]}}</tool_call>',
    "indented": '<tool_call>\n{"name": "f",\n "arguments": {\n  "x": 1.5\n }\n}\n</tool_call>',
}
# vLLM's streamed result (and where the whole block is in the output's last delta, what the
# serving layer's last step makes of it); ours is vLLM's non-streaming parser's result
DIFFERENT = {
    "ends in a tag's start": ('Hello <tool', ("Hello ", [])),  # the held "<tool" never sent
    "cut in the arguments": ('<tool_call>{"name": "f", "arguments": {"x": "ab',
                             (None, [("f", '{"x": "ab')])),  # not JSON
    "not JSON": ("<tool_call>{not json</tool_call>", (None, [])),  # nothing at all
    "no arguments": ('<tool_call>{"name": "f"}</tool_call>', (None, [("f", "")]),
                     (None, [("f", "{}")])),
    "arguments first": ('<tool_call>{"arguments": {"name": "x"}, "name": "f"}</tool_call>',
                        (None, [("x", '{"name": "x"}, "name": "f"')])),  # the first "name"
    "a bad second block": ('<tool_call>{"name": "noop", "arguments": {}}</tool_call> tail '
                           "<tool_call>[1]</tool_call>", (None, [("noop", "{}")]),
                           (None, [("noop", "{}{}")])),  # not JSON
}
OUTPUTS = {**SAME, **SAME_JSON, **{k: v[0] for k, v in DIFFERENT.items()}}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("case", SAME)
def test_streamed_calls_are_vllms(case, chunking):
    deltas = CHUNKINGS[chunking](SAME[case])
    assert assemble(our_steps(deltas)) == assemble(vllm_steps(deltas)) == vllm_whole(SAME[case])


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("case", SAME_JSON)
def test_streamed_arguments_are_vllms_json_value(case, chunking):
    deltas = CHUNKINGS[chunking](SAME_JSON[case])
    (ours_content, ours), (theirs_content, theirs) = \
        assemble(our_steps(deltas)), assemble(vllm_steps(deltas))
    assert ours_content == theirs_content is None
    assert [n for n, _ in ours] == [n for n, _ in theirs] == ["f"]
    assert [json.loads(a) for _, a in ours] == [json.loads(a) for _, a in theirs]
    assert ours == vllm_whole(SAME_JSON[case])[1]  # ours re-serialized, as vLLM's whole parse
    assert ours != theirs  # vLLM streams the model's own text


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("case", DIFFERENT)
def test_where_vllms_streaming_differs_ours_is_its_whole_parse(case, chunking):
    output, theirs, *in_one = DIFFERENT[case]
    deltas = CHUNKINGS[chunking](output)
    assert assemble(vllm_steps(deltas)) == (in_one[0] if in_one and len(deltas) == 1
                                            else theirs)
    assert assemble(our_steps(deltas)) == vllm_whole(output)
    if case != "arguments first":  # the one block that is a well-formed call
        assert vllm_whole(output) == (output, [])


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("case", OUTPUTS)
def test_content_streams_as_vllms_delta_for_delta(case, chunking):
    """Before the output ends both send the same content in the same steps (text before the
    first tag, less a tail that could be the tag's start); we send no call before the end."""
    deltas = CHUNKINGS[chunking](OUTPUTS[case])
    ours, theirs = our_steps(deltas), vllm_steps(deltas)

    def content(steps):
        return [[d["content"] for d in step if d.get("content")] for step in steps]
    assert content(ours[:-1]) == content(theirs)
    assert not any(d.get("tool_calls") for step in ours[:-1] for d in step)


def test_vllm_streams_a_call_before_the_output_ends_we_at_its_end():
    deltas = CHUNKINGS["1 char"](TWO_CALLS)
    theirs = vllm_steps(deltas)
    first = next(i for i, step in enumerate(theirs) if step and step[0].get("tool_calls"))
    assert TWO_CALLS[:first + 1].endswith('"get_weather"')  # the name, once it is complete
    ours = our_steps(deltas)
    assert [d["tool_calls"][0]["index"] for d in ours[-1]] == [0, 0, 1, 1]  # opening, arguments
    for step, other in ((ours[-1][0], ours[-1][2]), (theirs[first][0], None)):
        call = step["tool_calls"][0]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        assert other is None or other["tool_calls"][0]["function"]["name"] == "noop"
