"""Which tool and structured-output requests we refuse, against vLLM 0.33.0's own checks
(tests/data/vllm_tools_v0_33_0.py, copied from the wheel: `ChatCompletionRequest`'s validators
`check_tool_usage` and `check_structured_outputs_count`, and `StructuredOutputsParams`, which
refuses two kinds of constraint): the same requests refused, tool refusals naming vLLM's field,
and the one place we refuse what vLLM takes said and shown."""
from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pydantic
import pytest

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
    body = schemas.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                         tools=TOOLS, tool_choice=choice, structured_outputs=so)
    proxy = SimpleNamespace(tokenizer=SimpleNamespace(current=lambda: None))
    return our_refusal(lambda: tool_constraint(body, proxy))


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
