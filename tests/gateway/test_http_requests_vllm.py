"""Which tool and structured-output requests we refuse, against vLLM 0.33.0's own checks
(tests/data/vllm_tools_v0_33_0.py, copied from the wheel: `ChatCompletionRequest`'s validators
`check_tool_usage` and `check_structured_outputs_count`, and `StructuredOutputsParams`, which
refuses two kinds of constraint): the same requests refused, tool refusals naming vLLM's field,
and the one place we refuse what vLLM takes said and shown."""
from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import sys
from types import SimpleNamespace

import pydantic
import pytest
import xgrammar as xgr
import xgrammar.testing

from gateway.http import schemas, structured, tools
from gateway.http.errors import ApiError
from gateway.http.routes.chat import tool_constraint
from tests.data import vllm_tools_v0_33_0 as vllm

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "noop"}}]
NAMED = {"type": "function", "function": {"name": "noop"}}
KINDS = {"json": {"type": "object"}, "regex": "a+", "choice": ["a", "b"],
         "grammar": 'root ::= "a"', "json_object": True}
Request = vllm.ChatCompletionRequest


def vllm_refusal(check, data: dict, *more) -> str | None:
    """None when vLLM takes the request; else the field its error names ("" for none)."""
    try:
        check(Request, copy.deepcopy(data))
        for step in more:
            step(data)
    except (vllm.VLLMValidationError, pydantic.ValidationError) as exc:
        return getattr(exc, "parameter", None) or ""
    return None


def our_refusal(call) -> str | None:
    try:
        call()
    except ApiError as exc:
        assert exc.status == 400
        return exc.param
    return None


TOOL_CASES = [(None, None), (None, "none"), (None, "auto"), (None, "required"), ([], None),
              (TOOLS, None), (TOOLS, "none"), (TOOLS, "auto"), (TOOLS, "required"),
              (TOOLS, "sometimes"), (TOOLS, NAMED), (TOOLS, {"type": "function", "function": "f"}),
              (TOOLS, {"type": "function", "function": {}}),
              (TOOLS, {"type": "function", "function": {"name": ""}}),
              (TOOLS, {"type": "function", "function": {"name": "missing"}})]


@pytest.mark.parametrize("tool_list, choice", TOOL_CASES)
def test_tool_refusals_are_vllms(tool_list, choice):
    data = {"messages": []}
    if tool_list is not None:
        data["tools"] = tool_list
    if choice is not None:
        data["tool_choice"] = choice
    theirs = vllm_refusal(Request.check_tool_usage, data)
    ours = our_refusal(lambda: tools.plan(copy.deepcopy(tool_list), choice, None, None))
    assert ours == theirs


def _structured_outputs_step(data: dict) -> None:
    if data.get("structured_outputs") is not None:  # what pydantic makes of the field
        vllm.StructuredOutputsParams(**data["structured_outputs"])


@pytest.mark.parametrize("kinds", [*([k] for k in KINDS), *itertools.combinations(KINDS, 2)])
def test_one_kind_of_constraint_is_taken_two_are_refused_as_by_vllm(kinds):
    so = {k: KINDS[k] for k in kinds}
    theirs = vllm_refusal(Request.check_structured_outputs_count, {"structured_outputs": so},
                          _structured_outputs_step)
    ours = our_refusal(lambda: structured.from_request(None, copy.deepcopy(so)))
    assert (theirs is None) == (ours is None) == (len(kinds) == 1)
    assert ours in (None, "structured_outputs")  # ours names the field; vLLM's names none


def _ours_with_tools(choice, so) -> str | None:
    return our_refusal(lambda: _ours_with_constraint(choice, {"structured_outputs": so}))


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_a_named_choice_with_a_constraint_is_refused_by_both(kind):
    data = {"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {kind: KINDS[kind]}}
    assert vllm_refusal(Request.check_structured_outputs_count, data) == ""
    assert _ours_with_tools(NAMED, {kind: KINDS[kind]}) == "tool_choice"


def test_required_with_a_constraint_is_refused_by_us_only():
    """docs/structured_output.md says so: vLLM takes it (and its tool schema then replaces the
    constraint); we refuse a request whose two constraints cannot both hold."""
    data = {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a+"}}
    assert vllm_refusal(Request.check_structured_outputs_count, data) is None
    assert _ours_with_tools("required", {"regex": "a+"}) == "tool_choice"


# ---- `structured_outputs` with a `response_format`: vLLM merges them, we refuse the pair

SCHEMA_A = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_B = {"type": "object", "properties": {"b": {"type": "string"}}}
JSON_SCHEMA_B = {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA_B}}


def vllm_merged(so: dict | None, fmt: dict | None):
    """The constraint vLLM's ChatCompletionRequest.to_sampling_params uses
    (`extract_structured_outputs`), from the two fields as pydantic parses them."""
    request = SimpleNamespace(
        structured_outputs=None if so is None else vllm.StructuredOutputsParams(**so),
        response_format=None if fmt is None else vllm.ResponseFormat(**fmt))
    return Request.extract_structured_outputs(request)


@pytest.mark.parametrize("so, fmt, kind, value", [
    ({"json": SCHEMA_A}, JSON_SCHEMA_B, "json", SCHEMA_B),
    ({"json_object": True}, {"type": "json_object"}, "json_object", True),
    ({"json": SCHEMA_A}, {"type": "text"}, "json", SCHEMA_A),  # text: no constraint
])
def test_a_response_format_of_the_same_kind_silently_replaces_structured_outputs_in_vllm(
        so, fmt, kind, value):
    """docs/structured_output.md: vLLM takes both fields, and a `response_format` of the same
    kind as `structured_outputs` replaces it, with no error; we take one constraint only."""
    assert vllm_refusal(Request.check_structured_outputs_count, {"structured_outputs": so},
                        _structured_outputs_step) is None
    merged = vllm_merged(so, fmt)
    assert getattr(merged, kind) == value
    others = [k for k in KINDS if k != kind and getattr(merged, k) is not None]
    assert others == []  # the request's own structured_outputs value is gone
    ours = our_refusal(lambda: structured.from_request(copy.deepcopy(fmt), copy.deepcopy(so)))
    assert ours == (None if fmt["type"] == "text" else "structured_outputs")


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar", "json_object"])
def test_a_response_format_of_another_kind_is_refused_by_both(kind):
    """Two kinds once merged: StructuredOutputsParams refuses them, when vLLM builds the
    sampling parameters (an error naming no field); we refuse at the request, naming ours."""
    so = {kind: KINDS[kind]}
    # (pydantic wraps the dataclass's VLLMValidationError, a ValueError, as vLLM's does)
    with pytest.raises((vllm.VLLMValidationError, pydantic.ValidationError),
                       match="only use one kind"):
        vllm_merged(so, JSON_SCHEMA_B)
    assert our_refusal(lambda: structured.from_request(JSON_SCHEMA_B, so)) == \
        "structured_outputs"


# ---- a server without a tool parser: vLLM refuses tool choices, we choose by the template

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}")  # SmolLM2's kind: no tools, no <tool_call>


def vllm_render_without_parser(data: dict):
    """vLLM's OnlineRenderer.render_chat on a server started without --tool-call-parser (and
    so without --enable-auto-tool-choice, which needs it): the ErrorResponse it answers, or
    "rendered" when it goes on to the template (the rendering itself, past the check, is ours)."""
    renderer = object.__new__(vllm.OnlineRenderer)
    renderer.renderer = SimpleNamespace(tokenizer=object())
    renderer.parser, renderer.enable_auto_tools, renderer.use_harmony = None, False, False
    renderer.exclude_tools_when_tool_choice_none = renderer.trust_request_chat_template = False
    renderer.chat_template = renderer.chat_template_content_format = None
    renderer.default_chat_template_kwargs = {}

    async def preprocess_chat(*args, **kwargs):
        return "rendered", []
    renderer.preprocess_chat = preprocess_chat
    data = Request.check_tool_usage(Request, copy.deepcopy(data))  # sets tool_choice "auto"
    choice = data.get("tool_choice", "none")
    request = SimpleNamespace(
        messages=data["messages"], chat_template=None, chat_template_kwargs=None,
        tools=[vllm.ChatCompletionToolsParam(**t) for t in data["tools"]]
        if data.get("tools") else None,
        tool_choice=vllm.ChatCompletionNamedToolChoiceParam(**choice)
        if isinstance(choice, dict) else choice)
    result = asyncio.run(renderer.render_chat(request))
    return "rendered" if result == ("rendered", []) else result


@pytest.mark.parametrize("choice, message", [
    (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
           "to be set"),
    ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
             "to be set"),
    ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
    (NAMED, 'tool_choice=function "noop" requires --tool-call-parser to be set'),
    ("none", None),
])
def test_without_a_tool_parser_vllm_refuses_tool_choices_we_serve_them(choice, message):
    """docs/structured_output.md: without --tool-call-parser vLLM answers `auto`, `required`
    and a named choice with a 400; we serve them with a template that has no tool support:
    `auto` as plain content (no parser), `required` and named by their JSON schema."""
    data = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    if choice is not None:
        data["tool_choice"] = choice
    theirs = vllm_render_without_parser(data)
    if message is None:
        assert theirs == "rendered"
    else:
        assert (theirs.error.code, theirs.error.type, theirs.error.message) == \
            (400, "BadRequestError", message)
    body = schemas.ChatCompletionRequest(model="m", **data)
    proxy = SimpleNamespace(tokenizer=SimpleNamespace(
        current=lambda: SimpleNamespace(chat_template=CHATML)))
    plan, constraint = tool_constraint(body, proxy)
    assert plan.parser is None  # the template writes no <tool_call>
    assert plan.calls_tools == (choice in ("required", NAMED))
    assert (constraint is not None) == (choice in ("required", NAMED))


def test_without_tools_vllm_renders_as_we_do():
    assert vllm_render_without_parser({"messages": [{"role": "user", "content": "hi"}]}) == \
        "rendered"


# ---- `required` or a named choice with another constraint: vLLM's tool schema replaces it

class JsonListToolParser(vllm.ToolParser):
    """A vLLM tool parser that keeps ToolParser.adjust_request as it is: one without a
    structural tag of its own (0.33.0's PythonicToolParser, Granite20bFCToolParser, ...)."""


def vllm_adjusted(parser_cls, choice, constraint: dict, tool_list=TOOLS):
    """The request vLLM's parser leaves (`adjust_request`, run before sampling)."""
    return parser_cls(object()).adjust_request(vllm_request(choice, constraint, tool_list))


def vllm_request(choice, constraint: dict, tool_list=TOOLS):
    """A vLLM ChatCompletionRequest with tools, as pydantic makes its fields."""
    request = Request()  # the vendored class: its methods only, the fields set here
    request.tools = [vllm.ChatCompletionToolsParam(**t) for t in copy.deepcopy(tool_list)]
    request.tool_choice = vllm.ChatCompletionNamedToolChoiceParam(**choice) \
        if isinstance(choice, dict) else choice
    request.parallel_tool_calls, request.skip_special_tokens = None, None
    so, fmt = constraint.get("structured_outputs"), constraint.get("response_format")
    request.structured_outputs = None if so is None else vllm.StructuredOutputsParams(**so)
    request.response_format = None if fmt is None else vllm.ResponseFormat(**fmt)
    return request


CONSTRAINTS = [("required", {"structured_outputs": {"regex": "a+"}}),
               ("required", {"structured_outputs": {"json": SCHEMA_A}}),
               ("required", {"response_format": JSON_SCHEMA_B}),
               (NAMED, {"response_format": JSON_SCHEMA_B})]  # named + structured_outputs: 400


@pytest.mark.parametrize("choice, constraint", CONSTRAINTS)
def test_the_tool_schema_replaces_another_constraint_in_vllm(choice, constraint):
    """docs/structured_output.md: vLLM takes `required` (and a named choice with a
    `response_format`: its check counts only `structured_outputs`) with another constraint,
    and ToolParser.adjust_request replaces that constraint with the tool schema, which is ours;
    we refuse the request (400 naming `tool_choice`)."""
    data = {"tools": TOOLS, "tool_choice": choice, **copy.deepcopy(constraint)}
    assert vllm_refusal(Request.check_structured_outputs_count, data) is None
    adjusted = vllm_adjusted(JsonListToolParser, choice, constraint)
    ours = tools.constraint_schema(tools.plan(copy.deepcopy(TOOLS), choice, None, None), None)
    assert adjusted.structured_outputs == vllm.StructuredOutputsParams(json=ours)
    assert adjusted.response_format is None
    assert our_refusal(lambda: _ours_with_constraint(choice, constraint)) == "tool_choice"


def _ours_with_constraint(choice, constraint: dict):
    body = schemas.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                         tools=TOOLS, tool_choice=choice, **constraint)
    proxy = SimpleNamespace(tokenizer=SimpleNamespace(current=lambda: None))
    return tool_constraint(body, proxy)


def vllm_hermes_adjusted(choice, constraint: dict, monkeypatch, tool_list=TOOLS):
    """The request vLLM's serving layer leaves with `--tool-call-parser hermes`: its
    DelegatingParser.adjust_request (the structural tag, then the tool parser's own step)."""
    # get_structural_tag imports vLLM's registry module at call time: the copy stands for it
    monkeypatch.setitem(sys.modules, "vllm.tool_parsers.structural_tag_registry", vllm)
    parser = object.__new__(vllm.DelegatingParser)
    parser._reasoning_parser, parser.tool_strict_level = None, None  # no --tool-strict-level
    parser._tool_parser = vllm.Hermes2ProToolParser(object())
    return vllm_adjusted(lambda tokenizer: parser, choice, constraint, tool_list)


@pytest.mark.parametrize("choice, constraint", CONSTRAINTS)
def test_vllms_hermes_parser_replaces_the_constraint_by_its_structural_tag(
        choice, constraint, monkeypatch):
    """With VLLM_ENFORCE_STRICT_TOOL_CALLING at its default (on), a parser with a structural
    tag model, Hermes's among them, does not take the JSON `required`/named path
    (ToolParser.__init_subclass__; its adjust_request leaves the constraint): vLLM replaces the
    constraint by an xgrammar structural tag of Hermes blocks instead, whose arguments are any
    JSON unless the tool is `strict` (or the server's --tool-strict-level is `parameter`)."""
    assert vllm.envs.VLLM_ENFORCE_STRICT_TOOL_CALLING
    assert vllm.Hermes2ProToolParser.supports_required_and_named is False
    assert JsonListToolParser.supports_required_and_named is True
    alone = vllm_adjusted(vllm.Hermes2ProToolParser, choice, constraint)
    assert alone.structured_outputs == (vllm.StructuredOutputsParams(**constraint[
        "structured_outputs"]) if "structured_outputs" in constraint else None)
    adjusted = vllm_hermes_adjusted(choice, constraint, monkeypatch)
    assert adjusted.response_format is None and adjusted.skip_special_tokens is False
    so = adjusted.structured_outputs
    assert [k for k in (*KINDS, "structural_tag") if getattr(so, k) is not None] == \
        ["structural_tag"]
    tag = json.loads(so.structural_tag)["format"]
    assert tag["type"] == "tags_with_separator" and tag["at_least_one"] is True
    assert tag["stop_after_first"] is (choice == NAMED)
    names = ["noop"] if choice == NAMED else ["get_weather", "noop"]
    assert [(t["begin"], t["end"], t["content"]["type"], t["content"]["json_schema"])
            for t in tag["tags"]] == [
        (begin + name + '", "arguments": ', end, "json_schema", True)  # True: any JSON
        for name in names for begin, end in (('<tool_call>\n{"name": "', "}\n</tool_call>"),
                                             ('<tool_call>{"name": "', "}</tool_call>"))]
    grammar = xgr.Grammar.from_structural_tag(so.structural_tag)
    accepts = functools.partial(xgr.testing._is_grammar_accept_string, grammar)
    assert accepts('<tool_call>{"name": "noop", "arguments": {"any": ["json"]}}</tool_call>')
    assert not accepts(json.dumps([{"name": "noop", "parameters": {}}]) if choice ==
                       "required" else "{}")  # what our JSON schema makes the model write


def test_vllms_hermes_tag_holds_a_strict_tools_arguments_to_its_parameters(monkeypatch):
    strict = copy.deepcopy(TOOLS)
    strict[0]["function"]["strict"] = True
    data = {"structured_outputs": {"regex": "a+"}}
    request = vllm_hermes_adjusted("required", data, monkeypatch, strict)
    tags = json.loads(request.structured_outputs.structural_tag)["format"]["tags"]
    assert [t["content"]["json_schema"] for t in tags] == \
        [strict[0]["function"]["parameters"]] * 2 + [True] * 2


@pytest.mark.parametrize("enable_auto_tool_choice", [True, False])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_vllm_reads_its_hermes_tag_output_as_auto_with_auto_tool_choice_only(
        choice, enable_auto_tool_choice):
    """What each side parses out of what its constraint makes the model write: vLLM a Hermes
    block, through the Hermes parser as for `auto` (DelegatingParser._extract_tool_calls) when
    the server has --enable-auto-tool-choice, and no call without it; we our JSON output."""
    parser = object.__new__(vllm.DelegatingParser)
    parser._tool_parser, parser._engine_based = vllm.Hermes2ProToolParser(object()), False
    request = vllm_request(choice, {})
    output = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    calls, content = parser._extract_tool_calls(output, request, enable_auto_tool_choice)
    theirs = [(c.name, c.arguments) for c in calls]
    assert (theirs, content) == (([("noop", "{}")], None) if enable_auto_tool_choice
                                 else ([], output))
    plan = tools.plan(copy.deepcopy(TOOLS), choice, None, None)
    ours = tools.parse(plan, '[{"name": "noop", "parameters": {}}]' if choice == "required"
                       else "{}")
    assert [(c.name, c.arguments) for c in ours[1]] == [("noop", "{}")]
