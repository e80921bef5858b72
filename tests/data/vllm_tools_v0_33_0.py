# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Vendored from vLLM 0.33.0 (Apache License 2.0, https://github.com/vllm-project/vllm) by
# tests/data/vendor_vllm_tools.py (do not edit: rerun it). Source: `pip download --no-deps
# vllm==0.33.0`, wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
# (sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa); each copied piece below names its file and that file's sha256, and
# VENDORED_SHA256 at the end holds the sha256 of each piece's text as extracted from the wheel
# (tests/gateway/test_http_tools_vllm.py checks them). Longer than 400 lines: verbatim copies.
#
# ours, up to the first "---- vLLM" line: the imports the pieces need, and stand-ins for what
# they import from the rest of vLLM (its pydantic protocol classes, with the same fields; its
# error and logger). The OpenAI Responses types are the `openai` package's own.
# ruff: noqa
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import regex as re
from openai.types.responses import (
    CustomTool,
    FunctionTool,
    NamespaceTool,
    ToolChoiceCustom,
    ToolChoiceFunction,
)
from dataclasses import field

from pydantic import BaseModel
from pydantic.dataclasses import dataclass

logger = logging.getLogger("vllm_v0_33_0")


class VLLMValidationError(ValueError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = "chatcmpl-tool-vendored"
    type: Literal["function"] = "function"
    function: FunctionCall


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


Tool: TypeAlias = ChatCompletionToolsParam
ChatCompletionRequest: TypeAlias = Any
ConversationMessage: TypeAlias = dict[str, Any]
ExtractedToolCallInformation.model_rebuild()


def validate_structured_outputs_structural_tag(structured_outputs: Any) -> None:
    """vLLM checks a structural tag here; the tests send none."""


# ---- vLLM: vllm/tool_parsers/utils.py (file sha256 4ff79d1fd68d47b56eb038beb312d30c7a889811a33bc15ba6f18a67d39c8589)
def get_function_tools(
    tools: Sequence[Tool],
) -> list[ChatCompletionToolsParam | FunctionTool]:
    """Return the function tools the model is shown, in request order.

    This is the single source for both the chat template's tool list and the
    tools a tool-call grammar constrains, so the two cannot drift apart.
    Namespace functions are flattened to ``<namespace>__<name>``; custom tools
    become a single-string function shim. Other Responses tool types are never
    rendered for the model and are dropped.
    """
    function_tools: list[ChatCompletionToolsParam | FunctionTool] = []
    for tool in tools:
        if isinstance(tool, NamespaceTool):
            function_tools.extend(
                FunctionTool.model_validate(
                    {
                        **namespaced_tool.model_dump(by_alias=True),
                        "name": flat_namespace_tool_name(
                            tool.name, namespaced_tool.name
                        ),
                    }
                )
                for namespaced_tool in tool.tools
                if namespaced_tool.type == "function"
            )
        elif isinstance(tool, CustomTool):
            function_tools.append(
                FunctionTool.model_validate(custom_tool_as_function_dict(tool))
            )
        elif isinstance(tool, (FunctionTool, ChatCompletionToolsParam)):
            function_tools.append(tool)
    return function_tools


def require_function_tools(
    tools: Sequence[Tool],
) -> list[ChatCompletionToolsParam | FunctionTool]:
    """Return ``get_function_tools(tools)``, rejecting a request that has none.

    Raises:
        VLLMValidationError: ``tools`` has no tool the model can call, so a
            tool choice that requires a call can never be satisfied.

    """
    function_tools = get_function_tools(tools)
    if not function_tools:
        raise VLLMValidationError(
            "tool_choice requires a function call, but tools contains no "
            "function tool the model can call.",
            parameter="tool_choice",
        )
    return function_tools


def _extract_tool_info(
    tool: Tool,
) -> tuple[str, dict[str, Any] | None]:
    if isinstance(tool, FunctionTool):
        return tool.name, tool.parameters
    elif isinstance(tool, ChatCompletionToolsParam):
        return tool.function.name, tool.function.parameters
    else:
        raise TypeError(f"Unsupported tool type: {type(tool)}")


def _params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    # Empty/missing parameters still constrain arguments to a JSON object.
    return params if params else {"type": "object", "properties": {}}


def _get_tool_schema_from_name_and_params(
    name: str, params: dict[str, Any] | None
) -> dict:
    return {
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": _params_or_empty_object(params),
        },
        "required": ["name", "parameters"],
    }


def _get_tool_schema_from_tool(tool: Tool) -> dict:
    name, params = _extract_tool_info(tool)
    return _get_tool_schema_from_name_and_params(name, params)


def _get_tool_schema_defs(
    tools: list[Tool],
) -> dict:
    all_defs: dict[str, dict[str, Any]] = {}
    for tool in tools:
        name, params = _extract_tool_info(tool)
        if params is None:
            continue
        defs = params.pop("$defs", {})
        if not isinstance(defs, dict):
            raise VLLMValidationError(
                f"`$defs` in the parameters of tool '{name}' must be an "
                f"object, got {type(defs).__name__}.",
                parameter="tools",
            )
        for def_name, def_schema in defs.items():
            if def_name in all_defs and all_defs[def_name] != def_schema:
                raise VLLMValidationError(
                    f"Tool definition '{def_name}' has multiple schemas, "
                    "which is not supported.",
                    parameter="tools",
                )
            all_defs[def_name] = def_schema
    return all_defs


def _get_json_schema_from_tools(
    tools: list[Tool],
    parallel_tool_calls: bool | None = None,
) -> dict:
    fn_tools: list[Tool] = list(require_function_tools(tools))
    fn_tool_schemas = [_get_tool_schema_from_tool(tool) for tool in fn_tools]
    json_schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": fn_tool_schemas,
        },
    }
    # Only an explicit `false` opts out of parallel tool calls; `None` means the
    # field was never set and the default (true) applies.
    if parallel_tool_calls is False:
        json_schema["maxItems"] = 1
    json_schema_defs = _get_tool_schema_defs(fn_tools)
    if json_schema_defs:
        json_schema["$defs"] = json_schema_defs
    return json_schema


def get_json_schema_from_tools(
    tool_choice: (
        str | ToolChoiceFunction | ToolChoiceCustom | ChatCompletionNamedToolChoiceParam
    ),
    tools: list[Tool] | None,
    parallel_tool_calls: bool | None = None,
) -> str | dict | None:
    # tool_choice: "none"
    if tool_choice in ("none", None) or tools is None:
        return None
    # tool_choice: Forced Function (Responses)
    if (not isinstance(tool_choice, str)) and isinstance(
        tool_choice, (ToolChoiceFunction, ToolChoiceCustom)
    ):
        tool_name = tool_choice.name
        responses_tool_map: dict[str, dict[str, Any] | None] = {}
        for tool in tools:
            if not isinstance(tool, (FunctionTool, NamespaceTool, CustomTool)):
                continue
            for name, params in iter_response_function_tool_info(tool):
                responses_tool_map[name] = params
        if tool_name not in responses_tool_map:
            raise ValueError(f"Tool '{tool_name}' has not been passed in `tools`.")
        return _params_or_empty_object(responses_tool_map[tool_name])
    # tool_choice: Forced Function (ChatCompletion)
    if (not isinstance(tool_choice, str)) and isinstance(
        tool_choice, ChatCompletionNamedToolChoiceParam
    ):
        tool_name = tool_choice.function.name
        chat_tool_map: dict[str, ChatCompletionToolsParam] = {
            tool.function.name: tool
            for tool in tools
            if isinstance(tool, ChatCompletionToolsParam)
        }
        if tool_name not in chat_tool_map:
            raise ValueError(f"Tool '{tool_name}' has not been passed in `tools`.")
        return _params_or_empty_object(chat_tool_map[tool_name].function.parameters)
    # tool_choice: "required"
    if tool_choice == "required":
        return _get_json_schema_from_tools(tools, parallel_tool_calls)
    # tool_choice: "auto"
    return None




# ---- vLLM: vllm/renderers/chat_utils/chat_message.py (file sha256 0eb9f6ca4899700f937cc8fca85d919ac625ce4b34aa524e5c3e9963e8f61bf6)
def _postprocess_messages(messages: list[ConversationMessage]) -> None:
    # per the Transformers docs & maintainers, tool call arguments in
    # assistant-role messages with tool_calls need to be dicts not JSON str -
    # this is how tool-use chat templates will expect them moving forwards
    # so, for messages that have tool_calls, parse the string (which we get
    # from openAI format) to dict
    for message in messages:
        if message["role"] == "assistant" and "tool_calls" in message:
            tool_calls = message.get("tool_calls")
            if not isinstance(tool_calls, list):
                continue

            if len(tool_calls) == 0:
                # Drop empty tool_calls to keep templates on the normal assistant path.
                message.pop("tool_calls", None)
                continue

            for item in tool_calls:
                if not isinstance(item, dict):
                    raise VLLMValidationError(
                        "assistant tool_calls entries must be objects.",
                        parameter="tool_calls",
                    )

                function = item.get("function")
                if item.get("type", "function") != "function" or not isinstance(
                    function, dict
                ):
                    raise VLLMValidationError(
                        "chat completions only support assistant tool_calls "
                        "of type 'function'.",
                        parameter="tool_calls",
                    )

                # if arguments is None or empty string, set to {}
                if content := function.get("arguments"):
                    if isinstance(content, dict):
                        parsed = content
                    else:
                        if isinstance(content, str):
                            try:
                                parsed = json.loads(content)
                            except json.JSONDecodeError:
                                # A malformed `arguments` string lives in
                                # conversation history, so failing the request
                                # here would fail every subsequent turn too and
                                # leave the conversation unrecoverable. Coerce
                                # to an empty object so the turn can proceed.
                                logger.warning(
                                    "Tool call has arguments that are not valid "
                                    "JSON (%d chars); coercing to an empty object "
                                    "so the conversation can continue.",
                                    len(content),
                                )
                                parsed = None
                        else:
                            parsed = content

                        if not isinstance(parsed, dict):
                            if parsed is not None:
                                # Valid JSON, but not an object (e.g. "[]",
                                # "42", "true").
                                # Chat templates require a mapping.
                                logger.warning(
                                    "Tool call arguments decoded to %s, not a "
                                    "JSON object; coercing to an empty object.",
                                    type(parsed).__name__,
                                )
                            parsed = {}

                    function["arguments"] = parsed
                else:
                    function["arguments"] = {}




# ---- vLLM: vllm/tool_parsers/hermes_tool_parser.py (file sha256 2176dce9d3147b549bafab5ef76bc92e12a9614eeb0b61138dadfdc5959e21ef), class Hermes2ProToolParser
class Hermes2ProToolParser:  # ours: the class line only
    tool_call_start_token: str = "<tool_call>"
    tool_call_end_token: str = "</tool_call>"
    tool_call_regex = re.compile(
        r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL
    )
    def extract_tool_calls(
        self,
        model_output: str,
        request: ChatCompletionRequest,
    ) -> ExtractedToolCallInformation:
        # sanity check; avoid unnecessary processing
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=model_output
            )

        else:
            try:
                # there are two possible captures - between tags, or between a
                # tag and end-of-string so the result of
                # findall is an array of tuples where one is a function call and
                # the other is None
                function_call_tuples = self.tool_call_regex.findall(model_output)

                # load the JSON, and then use it to build the Function and
                # Tool Call
                raw_function_calls = [
                    json.loads(match[0] if match[0] else match[1])
                    for match in function_call_tuples
                ]
                tool_calls = [
                    ToolCall(
                        type="function",
                        function=FunctionCall(
                            name=function_call["name"],
                            # function call args are JSON but as a string
                            arguments=json.dumps(
                                function_call["arguments"], ensure_ascii=False
                            ),
                        ),
                    )
                    for function_call in raw_function_calls
                ]

                content = model_output[: model_output.find(self.tool_call_start_token)]
                return ExtractedToolCallInformation(
                    tools_called=True,
                    tool_calls=tool_calls,
                    content=content if content else None,
                )

            except Exception:
                logger.exception("Error in extracting tool call from response.")
                return ExtractedToolCallInformation(
                    tools_called=False, tool_calls=[], content=model_output
                )


# ---- vLLM: vllm/sampling_params.py (file sha256 deebc01732f3f7c14b9912dbed0190570015f5e0635c802c8293a508c36e4848)
@dataclass  # ours: vLLM's decorator (pydantic's)
class StructuredOutputsParams:
    # One of these fields will be used to build a logit processor.
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # These are other options that can be set.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    _backend: str | None = field(default=None, init=False)
    """CAUTION: Should only be set by Processor._validate_structured_output"""
    _backend_was_auto: bool = field(default=False, init=False)
    """CAUTION: Should only be set by Processor._validate_structured_output"""

    def __post_init__(self):
        """Validate that some fields are mutually exclusive."""
        count = sum(
            [
                self.json is not None,
                self.regex is not None,
                self.choice is not None,
                self.grammar is not None,
                self.json_object is not None,
                self.structural_tag is not None,
            ]
        )
        if count > 1:
            raise VLLMValidationError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise VLLMValidationError(
                "You must use one kind of structured outputs constraint "
                f"but none are specified: {self.__dict__}"
            )

    def all_constraints_none(self) -> bool:
        """Returns True if all structured-output constraint fields are None."""
        return all(
            getattr(self, field) is None
            for field in (
                "json",
                "regex",
                "choice",
                "grammar",
                "json_object",
                "structural_tag",
            )
        )

    def all_non_structural_tag_constraints_none(self) -> bool:
        """Returns True if all structured-output constraint fields are None."""
        return all(
            getattr(self, field) is None
            for field in (
                "json",
                "regex",
                "choice",
                "grammar",
                "json_object",
            )
        )




# ---- vLLM: vllm/entrypoints/openai/chat_completion/protocol.py (file sha256 e112a3c4c23e7a2e82a1964b39102d7209621f81f37810e741cf963cd50e1ec1), class ChatCompletionRequest
class ChatCompletionRequest:  # ours: the class line only
    def check_structured_outputs_count(cls, data):
        if isinstance(data, ValueError):
            raise data
        if not isinstance(data, dict):
            return data

        if data.get("structured_outputs", None) is None:
            return data

        structured_outputs_kwargs = data["structured_outputs"]
        # structured_outputs may arrive as a dict (from JSON/raw kwargs) or
        # as a StructuredOutputsParams dataclass instance.
        is_dataclass = isinstance(structured_outputs_kwargs, StructuredOutputsParams)
        count = sum(
            (
                getattr(structured_outputs_kwargs, k, None)
                if is_dataclass
                else structured_outputs_kwargs.get(k)
            )
            is not None
            for k in ("json", "regex", "choice")
        )
        # you can only use one kind of constraints for structured outputs
        if count > 1:
            raise VLLMValidationError(
                "You can only use one kind of constraints for structured "
                "outputs ('json', 'regex' or 'choice').",
            )
        # you can only either use structured outputs or tools, not both
        if count > 0 and data.get("tool_choice", "none") not in (
            "none",
            "auto",
            "required",
        ):
            raise VLLMValidationError(
                "You can only either use constraints for structured outputs "
                "or tools, not both.",
            )
        validate_structured_outputs_structural_tag(structured_outputs_kwargs)
        return data
    def check_tool_usage(cls, data):
        if isinstance(data, ValueError):
            raise data
        if not isinstance(data, dict):
            return data

        # Reject empty tools array, matching OpenAI API behavior
        if data.get("tools") == []:
            raise VLLMValidationError(
                "`tools` must not be an empty array. "
                "Either provide at least one tool or omit the field entirely.",
                parameter="tools",
            )

        # if "tool_choice" is not specified but tools are provided,
        # default to "auto" tool_choice
        if "tool_choice" not in data and data.get("tools"):
            data["tool_choice"] = "auto"

        # if "tool_choice" is "none" -- no validation is needed for tools
        if "tool_choice" in data and data["tool_choice"] == "none":
            return data

        # if "tool_choice" is specified -- validation
        if "tool_choice" in data and data["tool_choice"] is not None:
            # ensure that if "tool choice" is specified, tools are present
            if "tools" not in data or data["tools"] is None:
                raise VLLMValidationError(
                    "When using `tool_choice`, `tools` must be set.",
                    parameter="tool_choice",
                )

            # make sure that tool choice is either a named tool
            # OR that it's set to "auto" or "required"
            if data["tool_choice"] not in ["auto", "required"] and not isinstance(
                data["tool_choice"], dict
            ):
                raise VLLMValidationError(
                    f"Invalid value for `tool_choice`: {data['tool_choice']}! "
                    'Only named tools, "none", "auto" or "required" '
                    "are supported.",
                    parameter="tool_choice",
                )

            # ensure that if "tool_choice" is specified as an object,
            # it matches a valid tool
            correct_usage_message = (
                'Correct usage: `{"type": "function",'
                ' "function": {"name": "my_function"}}`'
            )
            if isinstance(data["tool_choice"], dict):
                valid_tool = False
                function = data["tool_choice"].get("function")
                if not isinstance(function, dict):
                    raise VLLMValidationError(
                        f"Invalid value for `function`: `{function}` in "
                        f"`tool_choice`! {correct_usage_message}",
                        parameter="tool_choice.function",
                    )
                if "name" not in function:
                    raise VLLMValidationError(
                        f"Expected field `name` in `function` in "
                        f"`tool_choice`! {correct_usage_message}",
                        parameter="tool_choice.function.name",
                    )
                function_name = function["name"]
                if not isinstance(function_name, str) or len(function_name) == 0:
                    raise VLLMValidationError(
                        f"Invalid `name` in `function`: `{function_name}`"
                        f" in `tool_choice`! {correct_usage_message}",
                        parameter="tool_choice.function.name",
                    )
                for tool in data["tools"]:
                    if tool["function"]["name"] == function_name:
                        valid_tool = True
                        break
                if not valid_tool:
                    raise VLLMValidationError(
                        "The tool specified in `tool_choice` does not match any"
                        " of the specified `tools`",
                        parameter="tool_choice",
                    )
        return data

# ours: the sha256 of each copied text, as extracted from the wheel
VENDORED_SHA256 = {
    'get_function_tools': 'd45540090d5ccb970d6e8c259e6f0102b058d8da54d55e8eddd21f40bd41306a',
    'require_function_tools': '257f110d7327a9aac97fb4dd7aae90be9a406492a132ffff97f8b1c153f4fd9a',
    '_extract_tool_info': '0a732698ceca31660575e34162d7212f3859af88cd0e7dabaacf5e2fadbb9ba6',
    '_params_or_empty_object': '6d0041f9d15fa553755e4d81b3e08418c070b0e867f1bc2c27eff78ad0126097',
    '_get_tool_schema_from_name_and_params': 'be39d5e8ba8827289631d032db9235d8bdbe36583edc92b3affbd9d1e4d58d01',
    '_get_tool_schema_from_tool': '617a5fff78b7ef87fead88600afa8b24d5f69440aedabe011374c3a3bb126ecc',
    '_get_tool_schema_defs': '16cb19d14c3905e8439f1f98e0983277af268ae7dbb92180523dd2b5c7560314',
    '_get_json_schema_from_tools': '85895c970416323b6cb7986990c47ca77654fefa7d7a9c6de9cb0e56592dd4bc',
    'get_json_schema_from_tools': '7247f3b7ce66f49ea63c074cd38cb3fe57ab6ac338713dc4b47d572079fc996d',
    '_postprocess_messages': '2b8e88dac34c0e96cca7ac2eb909867fe03cd8398cbbf307293455e613e213ea',
    'Hermes2ProToolParser.tool_call_start_token': 'f5796d36019dc709e390996a4381d926f9742abca95c22cf60d5d1a9ffec35d4',
    'Hermes2ProToolParser.tool_call_end_token': '769459712fb59df5b362f0df7e0b6dcc6fb213c6b4d30160eaefb915ab960604',
    'Hermes2ProToolParser.tool_call_regex': 'c3003c48ed91bd367420ef64e53cd98e0ad5dfde6c29817f5e4ea8ea1113cb3a',
    'Hermes2ProToolParser.extract_tool_calls': '5bcb34d61aa897d569a13113a68bd3780d45d7e3216fe7aa52b3ef622c554347',
    'StructuredOutputsParams': 'd0c18be79bc23dc7d64f653b3dc4c39b54e68a5fd007cb4787490f8d27c78475',
    'ChatCompletionRequest.check_structured_outputs_count': '1a3154a585e4200e954d70984c8e34aee4e6a5601f8f7886a5014ecd960be62e',
    'ChatCompletionRequest.check_tool_usage': '37fbebabbd0008fb62facee3b1b186f835800d6675a29b20826461456238866f',
}
