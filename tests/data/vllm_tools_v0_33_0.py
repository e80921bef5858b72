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
# error, logger, environment variable and tokenizer checks; the server state that
# OnlineRenderer.render_chat reads is set by the test). The OpenAI Responses types are the
# `openai` package's own.
# ruff: noqa
import contextlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from http import HTTPStatus
from json import JSONDecodeError
from typing import Any, Literal, TypeAlias, TypeVar, cast

import regex as re
from openai.types.responses import (
    CustomTool,
    FunctionTool,
    NamespaceTool,
    ResponseFormatTextJSONSchemaConfig,
    ResponseTextConfig,
    ToolChoiceCustom,
    ToolChoiceFunction,
)
from openai.types.responses.response import ToolChoice as ResponsesToolChoice
from openai.types.responses.tool import Tool as ResponsesTool
from openai.types.responses.tool_choice_allowed import ToolChoiceAllowed
from xgrammar import StructuralTag, normalize_tool_choice
from xgrammar import get_model_structural_tag as get_xgrammar_model_structural_tag
from xgrammar.openai_tool_call_schema import BuiltinToolParam, FunctionToolParam
from xgrammar.structural_tag import (
    AnyTextFormat,
    JSONSchemaFormat,
    OrFormat,
    TagFormat,
    TagsWithSeparatorFormat,
    TokenTriggeredTagsFormat,
    TriggeredTagsFormat,
)
import enum
from dataclasses import MISSING, field, fields, is_dataclass

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_serializer
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

class _Logger(logging.LoggerAdapter):
    """vLLM's logger: a logging.Logger with `warning_once` (here, a plain warning)."""
    def warning_once(self, msg, *args, scope=None):
        self.warning(msg, *args)


logger = _Logger(logging.getLogger("vllm_v0_33_0"))


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


Tool: TypeAlias = ChatCompletionToolsParam
ChatCompletionRequest: TypeAlias = Any
ConversationMessage: TypeAlias = dict[str, Any]


def validate_structured_outputs_structural_tag(structured_outputs: Any) -> None:
    """vLLM checks a structural tag here; the tests send none."""


class envs:
    """vllm/envs.py: the one variable read here, as vLLM reads it (default on)."""
    VLLM_ENFORCE_STRICT_TOOL_CALLING = (
        os.getenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "True").lower() in ("true", "1"))


class OpenAIBaseModel(BaseModel):
    """vLLM's base of its protocol classes, without its validator that logs extra fields."""
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ResponsesRequest(BaseModel):
    """The Responses API's request: only its type is read here (the tests send chat requests)."""


def is_mistral_tokenizer(tokenizer: Any) -> bool:
    """vLLM's check for a Mistral tokenizer (the tests use none)."""
    return False


TokenizerLike: TypeAlias = Any
EngineInput: TypeAlias = Any
AnyResponseFormat: TypeAlias = Any
ConfigType: TypeAlias = type
ConfigT = TypeVar("ConfigT")


def record_tool_parser_invocation(*, is_tool_called, is_streaming, request) -> None:
    """vLLM's metrics of tool parsing (here, none)."""



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


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest prefix of *tag* that matches a suffix of *text*.

    E.g. text ending in ``"<tool_"`` returns 6 when tag is ``"<tool_call>"``.
    Returns 0 when there is no overlap.
    """
    max_check = min(len(tag) - 1, len(text))
    for k in range(max_check, 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(input_str: str) -> bool:
    try:
        json.loads(input_str)
        return True
    except JSONDecodeError:
        return False




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




# ---- vLLM: vllm/utils/__init__.py (file sha256 c58b3f45deeb98bccca22c945526fd15d483a2f5eb8a3c62cf7df218b081885f)
MASK_64_BITS = (1 << 64) - 1


def random_uuid() -> str:
    return f"{uuid.uuid4().int & MASK_64_BITS:016x}"




# ---- vLLM: vllm/renderers/chat_utils/tool_call.py (file sha256 ba40d87fe363eea14427eb3c5abbb81d8b1bdd501b5abc800d6fff3cc9ea5611)
def make_tool_call_id(id_type: str = "random", func_name=None, idx=None):
    if id_type == "kimi_k2":
        return f"functions.{func_name}:{idx}"
    else:
        # by default return random
        return f"chatcmpl-tool-{random_uuid()}"




# ---- vLLM: vllm/entrypoints/generate/base/protocol.py (file sha256 0c07e689fdbbb59929fc8599f714b8041eec0dcd7fb16d87bb59bc80c5874803)
class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # schema is the field in openai but that causes conflicts with pydantic so
    # instead use json_schema with an alias
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    # type must be "json_schema", "json_object", or "text"
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class FunctionCall(OpenAIBaseModel):
    # Internal field to preserve native tool call ID from tool parser.
    # Excluded from serialization to maintain OpenAI API compatibility
    # (function object should only contain 'name' and 'arguments').
    id: str | None = Field(default=None, exclude=True)
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class ExtractedToolCallInformation(BaseModel):
    # indicate if tools were called
    tools_called: bool

    # extracted tool calls
    tool_calls: list[ToolCall]

    # content - per OpenAI spec, content AND tool calls can be returned rarely
    # But some models will do this intentionally
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        if len(data.get("tool_calls", [])) == 0:
            data.pop("tool_calls", None)
        return data




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




# ---- vLLM: vllm/config/utils.py (file sha256 eb3f40bb32522dfdd802f9c456184c501d30dc0fcd36d0edebcb04b510e3ec8b)
def get_field(cls: ConfigType, name: str) -> Any:
    """Get the default factory field of a dataclass by name. Used for getting
    default factory fields in `EngineArgs`."""
    if not is_dataclass(cls):
        raise TypeError("The given class is not a dataclass.")
    try:
        named_field = next(f for f in fields(cls) if f.name == name)
    except StopIteration as e:
        raise ValueError(f"Field '{name}' not found in {cls.__name__}.") from e

    # The arguments to copy to the new field
    default = named_field.default
    default_factory = named_field.default_factory
    init = named_field.init

    # Handle pydantic.Field
    if isinstance(default, FieldInfo):
        if default.init is not None:
            init = default.init
        if default.default_factory is not None:
            default_factory = cast(Callable[[], Any], default.default_factory)
            default = MISSING
        else:
            default = default.default

    if default is MISSING and default_factory is MISSING:
        logger.warning_once(
            "%s.%s has no default or default factory.", cls.__name__, name
        )
    return field(default=default, default_factory=default_factory, init=init)


def is_init_field(cls: ConfigType, name: str) -> bool:
    return get_field(cls, name).init


def replace(dataclass_instance: ConfigT, /, **kwargs) -> ConfigT:
    """Like [`dataclasses.replace`](https://docs.python.org/3/library/dataclasses.html#dataclasses.replace),
    but compatible with Pydantic dataclasses which use `pydantic.fields.Field` instead
    of `dataclasses.field`"""
    cls = type(dataclass_instance)
    dataclass_dict = dataclass_instance.__dict__
    dataclass_dict = {k: v for k, v in dataclass_dict.items() if is_init_field(cls, k)}
    dataclass_dict.update(kwargs)
    return cls(**dataclass_dict)




# ---- vLLM: vllm/entrypoints/generate/base/protocol.py (file sha256 0c07e689fdbbb59929fc8599f714b8041eec0dcd7fb16d87bb59bc80c5874803)
def structured_outputs_from_response_format(
    structured_outputs: StructuredOutputsParams | None,
    response_format: AnyResponseFormat | None,
) -> StructuredOutputsParams | None:
    """Apply ``response_format`` overrides to ``structured_outputs``."""
    if response_format is None or response_format.type == "text":
        return structured_outputs

    overrides: dict[str, Any]
    if response_format.type == "json_object":
        overrides = {"json_object": True}
    elif response_format.type == "json_schema":
        json_schema = response_format.json_schema
        assert json_schema is not None
        overrides = {"json": json_schema.json_schema}
    else:
        assert isinstance(
            response_format,
            (
                LegacyStructuralTagResponseFormat,
                StructuralTagResponseFormat,
            ),
        )
        overrides = {
            "structural_tag": json.dumps(response_format.model_dump(by_alias=True))
        }

    if structured_outputs is None:
        return StructuredOutputsParams(**overrides)

    return replace(structured_outputs, **overrides)




# ---- vLLM: vllm/tool_parsers/tool_strict_level.py (file sha256 87a07d7ed5274e760e35ccb6b1d9c186d1c2982508b7cdca5121fe96a6446586)
class ToolStrictLevel(enum.IntEnum):
    """Server-side floor for tool-call structural tags (``--tool-strict-level``).

    AUTO:      derive call constraints from ``tool_choice`` and argument-schema
               enforcement from each tool's explicit ``strict`` field.
    FUNCTION:  constrain the tool-call envelope for every request with tools.
    PARAMETER: additionally pin argument schemas, as if every tool were
               ``strict: true``.
    """

    AUTO = 0
    FUNCTION = 1
    PARAMETER = 2

    @classmethod
    def from_name(cls, name: str) -> "ToolStrictLevel":
        try:
            return cls[name.strip().upper()]
        except KeyError:
            expected = ", ".join(level.name.lower() for level in cls)
            raise ValueError(
                f"Unknown tool strict level {name!r}; expected one of {expected}."
            ) from None




# ---- vLLM: vllm/tool_parsers/structural_tag_registry.py (file sha256 89cba76c81d5976a7b3fa7403817bf369b8bb244cc5c424d04ba6da6ef36e47f)
ToolChoice: TypeAlias = (
    Literal["none", "auto", "required"]
    | ChatCompletionNamedToolChoiceParam
    | ResponsesToolChoice
    | None
)


AllowedToolRef: TypeAlias = dict[str, object]


SimplifiedToolChoice: TypeAlias = Literal["auto", "required", "forced"]


StructuralTagBuilder: TypeAlias = Callable[
    [
        list[FunctionToolParam],
        list[BuiltinToolParam],
        SimplifiedToolChoice,
        bool,
        str,
    ],
    StructuralTag,
]


XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS = frozenset(
    {
        "llama",
        "kimi",
        "deepseek_r1",
        "deepseek_v3_1",
        "qwen_3_5",
        "qwen_3_coder",
        "mimo",
        "qwen_3",
        "deepseek_v3_2",
        "deepseek_v4",
        "deepseek_v4_1",
    }
)


VLLM_BUILTIN_STRUCTURAL_TAG_MODELS = frozenset(
    {"glm_4_7", "hermes", "hy_v4", "kimi_k3", "longcat", "plamo3"}
)


SUPPORTED_STRUCTURAL_TAG_MODELS = (
    XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS | VLLM_BUILTIN_STRUCTURAL_TAG_MODELS
)


_VLLM_STRUCTURAL_TAG_REGISTRY: dict[str, StructuralTagBuilder] = {}


_BUILTIN_TOOL_STRUCTURAL_TAG_MODELS: set[str] = set()


def register_vllm_structural_tag(
    model: str,
    *,
    builtin_tools: bool = False,
) -> Callable[[StructuralTagBuilder], StructuralTagBuilder]:
    """Register a vLLM-owned structural tag builder.

    Args:
        model: Structural tag model key.
        builtin_tools: Whether the model can call non-function tools, so its
            builder receives every request tool instead of only the function
            tools from ``get_function_tools``.

    """

    def decorator(func: StructuralTagBuilder) -> StructuralTagBuilder:
        _VLLM_STRUCTURAL_TAG_REGISTRY[model] = func
        if builtin_tools:
            _BUILTIN_TOOL_STRUCTURAL_TAG_MODELS.add(model)
        return func

    return decorator


def get_structural_tag_tools(
    model: str,
    tools: Sequence[ChatCompletionToolsParam | ResponsesTool],
    tool_choice: ToolChoice,
) -> Sequence[ChatCompletionToolsParam | ResponsesTool]:
    """Return the tools a structural tag for ``model`` lets the model call.

    Most models are only shown function tools, so their grammar must cover
    exactly those: a tool missing from the prompt cannot be called, and one
    missing from the grammar is shown but blocked.

    Raises:
        VLLMValidationError: ``tool_choice`` requires a call, but the model
            has no tool it can call.

    """
    if model in _BUILTIN_TOOL_STRUCTURAL_TAG_MODELS:
        return tools
    if (
        tool_choice is None
        or tool_choice == "auto"
        or getattr(tool_choice, "mode", None) == "auto"
    ):
        return get_function_tools(tools)
    return require_function_tools(tools)


def _tool_is_strict(tool: ChatCompletionToolsParam | ResponsesTool) -> bool:
    if isinstance(tool, FunctionTool):
        return tool.strict is True
    if isinstance(tool, ChatCompletionToolsParam):
        return tool.function.strict is True
    return False


def _any_tool_strict(
    tools: Sequence[ChatCompletionToolsParam | ResponsesTool],
) -> bool:
    return any(_tool_is_strict(tool) for tool in tools)


def _with_tool_strict(
    tool: ChatCompletionToolsParam | ResponsesTool,
    strict: bool,
) -> ChatCompletionToolsParam | ResponsesTool:
    """Return a copy of ``tool`` with ``strict`` set, leaving the request's alone."""
    if isinstance(tool, FunctionTool):
        return tool.model_copy(update={"strict": strict})
    if isinstance(tool, ChatCompletionToolsParam):
        return tool.model_copy(
            update={"function": tool.function.model_copy(update={"strict": strict})}
        )
    return tool


def resolve_tool_strictness(
    tools: Sequence[ChatCompletionToolsParam | ResponsesTool],
    tool_choice: ToolChoice,
    strict_level: ToolStrictLevel,
) -> Sequence[ChatCompletionToolsParam | ResponsesTool] | None:
    """Decide whether a structural tag applies and pin each tool's ``strict``.

    A tool without an explicit ``strict`` is treated as non-strict: its call
    envelope is still constrained, but its arguments stay free unless the
    server level is PARAMETER. ``None`` means no structural tag.
    """
    if (
        tool_choice == "auto"
        and strict_level == ToolStrictLevel.AUTO
        and not _any_tool_strict(tools)
    ):
        return None
    return [
        _with_tool_strict(
            tool, strict_level >= ToolStrictLevel.PARAMETER or _tool_is_strict(tool)
        )
        for tool in tools
    ]


def get_model_structural_tag(
    model: str,
    tools: Sequence[ChatCompletionToolsParam | ResponsesTool] | None,
    tool_choice: ToolChoice,
    reasoning: bool,
    token_suffix: str = "",
    strict_level: ToolStrictLevel = ToolStrictLevel.AUTO,
) -> StructuralTag | None:
    """Build a structural tag with xgrammar's builtin model templates."""
    if not tools or tool_choice == "none":
        return None

    tools = get_structural_tag_tools(model, tools, tool_choice)
    if not tools:
        return None
    tools = resolve_tool_strictness(tools, tool_choice, strict_level)
    if tools is None:
        return None

    dumped_tools = [_dump_tool_for_xgrammar(tool) for tool in tools]
    dumped_tool_choice = _dump_tool_choice_for_xgrammar(tool_choice)

    if model in _VLLM_STRUCTURAL_TAG_REGISTRY:
        function_tools, builtin_tools, simplified_tool_choice = normalize_tool_choice(
            dumped_tools,
            dumped_tool_choice,
        )
        return _VLLM_STRUCTURAL_TAG_REGISTRY[model](
            function_tools,
            builtin_tools,
            simplified_tool_choice,
            reasoning,
            token_suffix,
        )

    if model not in XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS:
        supported = sorted(SUPPORTED_STRUCTURAL_TAG_MODELS)
        raise ValueError(f"Unknown format type: {model}, supported types: {supported}")

    if token_suffix:
        raise ValueError(
            f"Structural tag model {model!r} is an xgrammar builtin with fixed "
            f"tokens and cannot apply token_suffix={token_suffix!r}"
        )

    return get_xgrammar_model_structural_tag(
        model=model,
        tools=dumped_tools,
        tool_choice=dumped_tool_choice,
        reasoning=reasoning,
    )


_TOOL_CALL_LIST_FORMATS = (
    TriggeredTagsFormat,
    TokenTriggeredTagsFormat,
    TagsWithSeparatorFormat,
)


def limit_to_single_tool_call(tag: StructuralTag) -> StructuralTag:
    """Stop every tool-call list in ``tag`` after its first call, in place.

    Enforces ``parallel_tool_calls=false`` in the grammar. In every registered
    tag, ``_TOOL_CALL_LIST_FORMATS`` repeat tool calls, never arguments.
    """

    def visit(node: Any) -> None:
        if isinstance(node, BaseModel):
            if isinstance(node, _TOOL_CALL_LIST_FORMATS):
                node.stop_after_first = True
            for name in type(node).model_fields:
                visit(getattr(node, name))
        elif isinstance(node, (list, tuple)):
            for item in node:
                visit(item)

    visit(tag.format)
    return tag


def _dump_tool_for_xgrammar(
    tool: ChatCompletionToolsParam | ResponsesTool,
) -> dict[str, Any]:
    """Convert tool objects to xgrammar's Chat Completions tool protocol."""
    if isinstance(tool, FunctionTool):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        if tool.strict is not None:
            function["strict"] = tool.strict
        return {"type": "function", "function": function}
    if isinstance(tool, CustomTool):
        function = {"name": tool.name, "parameters": custom_tool_parameters()}
        if tool.description is not None:
            function["description"] = tool.description
        return {"type": "function", "function": function}
    dumped_tool = tool.model_dump(mode="json", exclude_none=True)
    if isinstance(tool, ChatCompletionToolsParam):
        return dumped_tool
    return dict(dumped_tool)


def _dump_tool_choice_for_xgrammar(
    tool_choice: ToolChoice,
) -> dict[str, Any] | str | None:
    """Convert tool_choice objects to xgrammar's expected protocol."""
    if tool_choice is None:
        return None

    if isinstance(tool_choice, str):
        return tool_choice

    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        return tool_choice.model_dump(mode="json", exclude_none=True)

    if isinstance(tool_choice, (ToolChoiceFunction, ToolChoiceCustom)):
        return {
            "type": "function",
            "function": {"name": tool_choice.name},
        }

    if isinstance(tool_choice, ToolChoiceAllowed):
        return {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": tool_choice.mode,
                "tools": [
                    _dump_allowed_tool_ref_for_xgrammar(tool)
                    for tool in tool_choice.tools
                ],
            },
        }

    return tool_choice.model_dump(mode="json", exclude_none=True)


def _dump_allowed_tool_ref_for_xgrammar(tool_ref: AllowedToolRef) -> AllowedToolRef:
    if (
        tool_ref.get("type") == "function"
        and "function" not in tool_ref
        and "name" in tool_ref
    ):
        return {
            "type": "function",
            "function": {"name": tool_ref["name"]},
        }
    return tool_ref


def get_function_parameters(function) -> dict[str, Any] | bool:
    if getattr(function, "strict", None) is False:
        return True
    return function.parameters if function.parameters is not None else True


def _hermes_tool_tags(
    tools: list[FunctionToolParam],
    start_tag: str,
    end_tag: str,
) -> list[TagFormat]:
    arguments_field_prefix = '", "arguments": '
    formats = [
        # <tool_call>
        # {"name": "t1", "arguments": {"q": "v"}}
        # </tool_call>
        (start_tag + '\n{"name": "', "}\n" + end_tag),
        # <tool_call>{"name": "t1", "arguments": {"q": "v"}}</tool_call>
        (start_tag + '{"name": "', "}" + end_tag),
    ]

    return [
        TagFormat(
            begin=begin + tool.function.name + arguments_field_prefix,
            content=JSONSchemaFormat(
                json_schema=get_function_parameters(tool.function)
            ),
            end=end,
        )
        for tool in tools
        for begin, end in formats
    ]


def _hermes_style_structural_tag(
    tools: list[FunctionToolParam],
    tool_choice: SimplifiedToolChoice,
    start_tag: str,
    end_tag: str,
) -> StructuralTag:
    tags = _hermes_tool_tags(tools, start_tag, end_tag)
    if tool_choice == "auto":
        suffix_tag = (
            TriggeredTagsFormat(triggers=[start_tag], tags=tags)
            if tags
            else AnyTextFormat()
        )
    elif tool_choice == "forced":
        suffix_tag = TagsWithSeparatorFormat(
            tags=tags,
            separator="",
            at_least_one=True,
            stop_after_first=True,
        )
    else:
        suffix_tag = TagsWithSeparatorFormat(
            tags=tags,
            separator="",
            at_least_one=True,
        )

    return StructuralTag(format=suffix_tag)


@register_vllm_structural_tag("hermes")  # ours: vLLM's decorator
def get_hermes_structural_tag(
    tools: list[FunctionToolParam],
    builtin_tools: list[BuiltinToolParam],
    tool_choice: SimplifiedToolChoice,
    reasoning: bool,
    token_suffix: str = "",
) -> StructuralTag:
    del builtin_tools, reasoning, token_suffix
    return _hermes_style_structural_tag(
        tools, tool_choice, "<tool_call>", "</tool_call>"
    )




# ---- vLLM: vllm/tool_parsers/abstract_tool_parser.py (file sha256 261e477a170acb0eb1b71a3254daecf733367e92049f59ccf93a2d7f357b4a8d), class ToolParser
class ToolParser:  # ours: the class line only
    supports_required_and_named: bool = True
    structural_tag_model: str | None = None
    default_tool_strict_level: ToolStrictLevel = ToolStrictLevel.AUTO
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if (
            cls.structural_tag_model is not None
            and envs.VLLM_ENFORCE_STRICT_TOOL_CALLING
        ):
            cls.supports_required_and_named = False
    def __init__(
        self,
        tokenizer: TokenizerLike,
        tools: list[Tool] | None = None,
    ):
        self.prev_tool_call_arr: list[dict] = []
        # the index of the tool call that is currently being parsed
        self.current_tool_id: int = -1
        self.current_tool_name_sent: bool = False
        self.streamed_args_for_tool: list[str] = []

        self.model_tokenizer = tokenizer
        if tools:
            self.tools: list[ChatCompletionToolsParam | FunctionTool] = [
                tool
                for tool in tools
                if isinstance(tool, (ChatCompletionToolsParam, FunctionTool))
            ]
        else:
            self.tools = []
    def get_remaining_unstreamed_args(self) -> str:
        """Return tool call arguments parsed but not yet streamed."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        if isinstance(args, str):
            expected = args
        else:
            expected = json.dumps(args, ensure_ascii=False)
        actual = (
            self.streamed_args_for_tool[index]
            if index < len(self.streamed_args_for_tool)
            else ""
        )
        if expected.startswith(actual):
            return expected[len(actual) :]
        return ""
    def adjust_request(
        self,
        request: ChatCompletionRequest | ResponsesRequest,
    ) -> ChatCompletionRequest | ResponsesRequest:
        # If there are no tools, return the request as is.
        if not request.tools:
            return request

        # Set structured output params when tool constraints are derived from
        # the tool schema. Unified parsers handle model-specific structural
        # tags before calling into the tool parser.
        structured_outputs = getattr(request, "structured_outputs", None)
        if (
            structured_outputs is not None
            and structured_outputs.structural_tag is not None
        ):
            return request

        # Parsers that extract required/named tool calls from their native
        # format (supports_required_and_named=False) must not be forced into
        # the JSON tool-call format below: they would never find a call in
        # the JSON output and would return it as content instead.
        if not self.supports_required_and_named:
            return request

        json_schema_from_tool = get_json_schema_from_tools(
            tool_choice=request.tool_choice,
            tools=request.tools,
            parallel_tool_calls=request.parallel_tool_calls,
        )
        # Set structured output params for tool calling
        if json_schema_from_tool is not None:
            if isinstance(request, ChatCompletionRequest):
                # tool_choice: "Forced Function" or "required" will override
                # structured output json settings to make tool calling work correctly
                request.structured_outputs = StructuredOutputsParams(
                    json=json_schema_from_tool  # type: ignore[call-arg]
                )
                request.response_format = None
            if isinstance(request, ResponsesRequest):
                # Single-shot construction so Pydantic v2 tracks `format`
                # in __fields_set__ — assigning to `.format` after the bare
                # `ResponseTextConfig()` constructor does not, which can
                # drop the nested config from `model_dump`. Also drop the
                # `description` kwarg: it is not a field on
                # ResponseFormatTextJSONSchemaConfig and was being silently
                # passed through as extra.
                request.text = ResponseTextConfig(
                    format=ResponseFormatTextJSONSchemaConfig(
                        type="json_schema",
                        name="tool_calling_response",
                        schema=json_schema_from_tool,
                        strict=True,
                    )
                )

        return request
    def get_structural_tag(
        self,
        request: ChatCompletionRequest | ResponsesRequest,
        *,
        reasoning: bool = False,
        strict_level: ToolStrictLevel = ToolStrictLevel.AUTO,
    ):
        if self.structural_tag_model is None:
            return None
        if not envs.VLLM_ENFORCE_STRICT_TOOL_CALLING:
            return None
        from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

        return get_model_structural_tag(
            model=self.structural_tag_model,
            tools=request.tools,
            tool_choice=request.tool_choice,
            reasoning=reasoning,
            strict_level=strict_level,
        )


# ---- vLLM: vllm/tool_parsers/hermes_tool_parser.py (file sha256 2176dce9d3147b549bafab5ef76bc92e12a9614eeb0b61138dadfdc5959e21ef), class Hermes2ProToolParser
class Hermes2ProToolParser(ToolParser):  # ours: the class line only
    structural_tag_model = "hermes"
    tool_call_start_token: str = "<tool_call>"
    tool_call_end_token: str = "</tool_call>"
    tool_call_regex = re.compile(
        r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL
    )
    def __init__(self, tokenizer: TokenizerLike, tools: list[Tool] | None = None):
        super().__init__(tokenizer, tools)

        if is_mistral_tokenizer(tokenizer):
            logger.error("Detected Mistral tokenizer when using a Hermes model")
            self.model_tokenizer = tokenizer.tokenizer

        if not self.model_tokenizer:
            raise ValueError(
                "The model tokenizer must be passed to the ToolParser "
                "constructor during construction."
            )

        # Streaming state: what has been sent to the client.
        self._sent_content_idx: int = 0
    def adjust_request(
        self, request: ChatCompletionRequest | ResponsesRequest
    ) -> ChatCompletionRequest | ResponsesRequest:
        request = super().adjust_request(request)
        if request.tools and request.tool_choice != "none":
            # do not skip special tokens because the tool_call tokens are
            # marked "special" in some models. Since they are skipped
            # prior to the call to the tool parser, it breaks tool calling.
            request.skip_special_tokens = False
        return request
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
    def _extract_content(self, current_text: str) -> str | None:
        """Return unsent non-tool-call text, or None.

        Holds back any suffix that could be a partial <tool_call> tag.
        """
        if self.tool_call_start_token not in current_text:
            overlap_length = partial_tag_overlap(
                current_text, self.tool_call_start_token
            )
            sendable_idx = len(current_text) - overlap_length
        else:
            sendable_idx = current_text.index(self.tool_call_start_token)

        if sendable_idx > self._sent_content_idx:
            content = current_text[self._sent_content_idx : sendable_idx]
            self._sent_content_idx = sendable_idx
            return content
        return None
    def _extract_tool_call_jsons(self, text: str) -> list[tuple[str, bool]]:
        """Extract (json_text, is_complete) for each <tool_call> region."""
        results: list[tuple[str, bool]] = []
        pos = 0
        while True:
            start = text.find(self.tool_call_start_token, pos)
            if start == -1:
                break
            json_start = start + len(self.tool_call_start_token)
            json_end = text.find(self.tool_call_end_token, json_start)
            if json_end != -1:
                results.append((text[json_start:json_end].strip(), True))
                pos = json_end + len(self.tool_call_end_token)
            else:
                raw = text[json_start:]
                # Strip partial </tool_call> suffix if present.
                overlap = partial_tag_overlap(raw, self.tool_call_end_token)
                if overlap:
                    raw = raw[:-overlap]
                tc_json = raw.strip()
                # Valid JSON without closing tag = complete body,
                # tag tokens just haven't arrived yet.
                is_complete = is_complete_json(tc_json) if tc_json else False
                results.append((tc_json, is_complete))
                break
        return results
    @staticmethod  # ours: vLLM's decorator
    def _extract_tool_name(tc_json: str) -> str | None:
        """Extract tool name, or None if the name isn't complete yet."""
        match = re.search(r'"name"\s*:\s*"([^"]+)"', tc_json)
        return match.group(1) if match else None
    @staticmethod  # ours: vLLM's decorator
    def _extract_tool_args(tc_json: str, is_complete: bool) -> str | None:
        """Extract tool arguments from the tool call JSON.

        Given {"name": "f", "arguments": {"x": 1}}, returns '{"x": 1}'.
        When is_complete, strips the trailing '}' that closes the outer
        object (not the arguments). For partial JSON, returns as-is.
        """
        match = re.search(r'"arguments"\s*:\s*', tc_json)
        if not match:
            return None
        raw = tc_json[match.end() :]
        if is_complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw
    def _compute_args_diff(
        self, index: int, tc_json: str, is_complete: bool
    ) -> str | None:
        """Return new argument text not yet sent for tool `index`, or None."""
        args = self._extract_tool_args(tc_json, is_complete)
        if args is None or len(args) <= len(self.streamed_args_for_tool[index]):
            return None
        diff = args[len(self.streamed_args_for_tool[index]) :]
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index]["arguments"] = args
        return diff
    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        """Incrementally stream tool call deltas from accumulated output.

        On each invocation, re-parses the full ``current_text`` to find
        ``<tool_call>`` regions, then diffs against previously sent state
        to emit only new content, tool names, or argument fragments.

        Returns a ``DeltaMessage`` containing either plain content (for
        text preceding any tool call) or one or more ``DeltaToolCall``
        entries, or ``None`` if there is nothing new to send yet."""
        try:
            # Extract any content before tool calls.
            content = self._extract_content(current_text)
            tool_call_jsons = self._extract_tool_call_jsons(current_text)
            tool_call_deltas: list[DeltaToolCall] = []

            for i, (tc_json, is_complete) in enumerate(tool_call_jsons):
                if i >= len(self.prev_tool_call_arr):
                    self.prev_tool_call_arr.append({})
                    self.streamed_args_for_tool.append("")

                # Stream back tool name.
                if "name" not in self.prev_tool_call_arr[i]:
                    name = self._extract_tool_name(tc_json)
                    if not name:
                        # Can't skip to tool i+1 if i isn't ready
                        break
                    self.prev_tool_call_arr[i]["name"] = name
                    tool_call_deltas.append(
                        DeltaToolCall(
                            index=i,
                            type="function",
                            id=make_tool_call_id(),
                            function=DeltaFunctionCall(name=name).model_dump(
                                exclude_none=True
                            ),
                        )
                    )

                # Stream back new tool args by diffing against what was sent.
                args_diff = self._compute_args_diff(i, tc_json, is_complete)
                if args_diff:
                    tool_call_deltas.append(
                        DeltaToolCall(
                            index=i,
                            function=DeltaFunctionCall(arguments=args_diff).model_dump(
                                exclude_none=True
                            ),
                        )
                    )

            if content or tool_call_deltas:
                return DeltaMessage(
                    content=content,
                    tool_calls=tool_call_deltas,
                )

            return None

        except Exception:
            logger.exception("Error trying to handle streaming tool call.")
            return None


# ---- vLLM: vllm/parser/abstract_parser.py (file sha256 050234f75f7406e2368b54ecbad95c5efe79fc8437afb2b0e515e571f5d6e311), class DelegatingParser
class DelegatingParser:  # ours: the class line only
    def _extract_tool_calls(
        self,
        content: str | None,
        request: ChatCompletionRequest | ResponsesRequest,
        enable_auto_tools: bool = False,
    ) -> tuple[list[FunctionCall] | None, str | None]:
        tool_parser = self._tool_parser
        if tool_parser is None:
            return [], content

        if request.tool_choice == "none":
            if self._engine_based:
                result = self.extract_tool_calls(content or "", request=request)
                return [], result.content
            return [], content

        supports_required_and_named = tool_parser.supports_required_and_named
        is_named_tool_choice = request.tool_choice and isinstance(
            request.tool_choice,
            (ToolChoiceFunction, ToolChoiceCustom, ChatCompletionNamedToolChoiceParam),
        )
        is_required_tool_choice = request.tool_choice == "required"
        is_auto_tool_choice = enable_auto_tools and (
            request.tool_choice == "auto"
            or request.tool_choice is None
            or (
                not supports_required_and_named
                and (is_named_tool_choice or is_required_tool_choice)
            )
        )

        tool_calls = list[FunctionCall]()
        if is_named_tool_choice and supports_required_and_named:
            if content is None or (isinstance(content, str) and not content.strip()):
                return [], None
            function_name = self._get_function_name(request)
            tool_calls.append(
                FunctionCall(
                    id=self._make_tool_call_id(function_name),
                    name=function_name,
                    arguments=content,
                )
            )
            content = None
        elif is_required_tool_choice and supports_required_and_named:
            # "required" with standard JSON-based parsing
            parsed_calls = []
            with contextlib.suppress(ValidationError):
                content = content or ""
                parsed_calls = TypeAdapter(list[FunctionDefinition]).validate_json(
                    content
                )
            for tc in parsed_calls:
                tool_calls.append(
                    FunctionCall(
                        id=self._make_tool_call_id(tc.name),
                        name=tc.name,
                        arguments=json.dumps(tc.parameters, ensure_ascii=False),
                    )
                )
            content = None
        elif is_auto_tool_choice:
            # Automatic Tool Call Parsing (also used as fallback for
            # required/named when supports_required_and_named=False)
            tool_call_info = self.extract_tool_calls(
                content if content is not None else "",
                request=request,
            )
            if tool_call_info is not None and tool_call_info.tools_called:
                tool_calls.extend(
                    FunctionCall(
                        id=tc.id,
                        name=tc.function.name,
                        arguments=tc.function.arguments,
                    )
                    for tc in tool_call_info.tool_calls
                )
                content = tool_call_info.content
                if content and content.strip() == "":
                    content = None
            else:
                # No tool calls.
                # For required/named tool choice (when falling back to auto
                # parsing), if content is empty or whitespace-only, return
                # empty list with None content.
                if (is_required_tool_choice or is_named_tool_choice) and (
                    content is None
                    or (isinstance(content, str) and not content.strip())
                ):
                    return [], None
                # No complete tool calls: for engine-based parsers, return
                # the tool parser's content, which drops incomplete
                # tool-call markup (e.g. a <tool_call> opener truncated by
                # max_tokens or a stop string), so the non-streaming path
                # matches streaming. Legacy parsers keep their existing
                # behavior of returning the raw content.
                if self._engine_based and tool_call_info is not None:
                    return None, tool_call_info.content or None
                return None, content

        return tool_calls, content
    def adjust_request(
        self, request: ChatCompletionRequest | ResponsesRequest
    ) -> ChatCompletionRequest | ResponsesRequest:
        if self._reasoning_parser is not None:
            request = self._reasoning_parser.adjust_request(request)
        if self._tool_parser is not None:
            request = self._apply_structural_tag(request)
            request = self._tool_parser.adjust_request(request)
        return request
    def _apply_structural_tag(
        self, request: ChatCompletionRequest | ResponsesRequest
    ) -> ChatCompletionRequest | ResponsesRequest:
        tool_parser = self._tool_parser
        if tool_parser is None or not request.tools:
            return request

        need_tool_calling = (
            request.tool_choice == "auto"
            or request.tool_choice == "required"
            or isinstance(
                request.tool_choice,
                (
                    ChatCompletionNamedToolChoiceParam,
                    ToolChoiceFunction,
                    ToolChoiceCustom,
                ),
            )
        )
        if not need_tool_calling:
            return request

        structured_outputs = request.extract_structured_outputs()
        is_auto = request.tool_choice == "auto"
        single_call = request.parallel_tool_calls is False
        strict_level = self.tool_strict_level
        if strict_level is None:
            strict_level = tool_parser.default_tool_strict_level
        if single_call and not (is_auto and structured_outputs is not None):
            # Limiting the call count needs the call envelope in the grammar.
            # Auto with structured outputs keeps its format-only grammar, so the
            # flag never makes calls possible that are impossible without it.
            strict_level = max(strict_level, ToolStrictLevel.FUNCTION)

        resolved_tools = None
        if tool_parser.structural_tag_model is not None:
            resolved_tools = resolve_tool_strictness(
                get_structural_tag_tools(
                    tool_parser.structural_tag_model,
                    request.tools,
                    request.tool_choice,
                ),
                request.tool_choice,
                strict_level,
            )

        output_format = None
        if resolved_tools and is_auto and structured_outputs:
            if not _xgrammar_supports(structured_outputs):
                logger.warning_once(
                    "Tool calls are not constrained for tool_choice=auto with "
                    "structured outputs because xgrammar does not support the "
                    "structured output constraint; the structured output "
                    "constraint applies.",
                    scope="local",
                )
                return request
            output_format = structured_outputs_to_format(structured_outputs)

        if resolved_tools is not None:
            tag_request = request
            if output_format is not None:
                # IMPORTANT(arpera):
                # The "auto" tag allows plain text in response.
                # Use tag "required" here to ensure structured-output branch
                # remains meaningful.
                tag_request = request.model_copy(update={"tool_choice": "required"})
            tools_structural_tag = tool_parser.get_structural_tag(
                tag_request,
                reasoning=False,
                strict_level=strict_level,
            )
        else:
            tools_structural_tag = None

        if tools_structural_tag is None:
            if is_auto and structured_outputs is not None:
                logger.warning_once(
                    "Tool calls are not constrained for tool_choice=auto with "
                    "structured outputs because structural tags are unavailable; "
                    "the structured output constraint applies.",
                    scope="local",
                )
            return request

        if single_call:
            limit_to_single_tool_call(tools_structural_tag)
        structural_tag = tools_structural_tag
        if output_format is not None:
            structural_tag = StructuralTag(
                format=OrFormat(elements=[tools_structural_tag.format, output_format])
            )
        elif structured_outputs is not None and not is_auto:
            logger.warning_once(
                "structured outputs are ignored because tool_choice forces tool call.",
                scope="local",
            )

        request.structured_outputs = StructuredOutputsParams(
            structural_tag=json.dumps(structural_tag.model_dump()),
        )
        if isinstance(request, ResponsesRequest):
            request.text = None
        else:
            request.response_format = None
        return request
    def extract_tool_calls(
        self,
        model_output: str,
        request: ChatCompletionRequest | ResponsesRequest,
    ) -> ExtractedToolCallInformation:
        if self._tool_parser is None:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=model_output
            )
        result = None
        is_tool_called: bool | Exception = False
        try:
            result = self._tool_parser.extract_tool_calls(
                model_output,
                request=request,  # type: ignore[arg-type]
            )
            is_tool_called = bool(result.tools_called)
        except Exception as e:
            is_tool_called = e
            raise
        finally:
            record_tool_parser_invocation(
                is_tool_called=is_tool_called,
                is_streaming=False,
                request=request,
            )
        return result
    def _append_unstreamed_tool_args(
        self,
        delta_message: DeltaMessage | None,
    ) -> None:
        """Append parsed-but-unstreamed tool-call arguments to *delta_message*."""
        if (
            self._tool_parser is not None
            and delta_message
            and delta_message.tool_calls
            and (last_tc := delta_message.tool_calls[-1]).function
        ):
            last_tc.function.arguments = (
                last_tc.function.arguments or ""
            ) + self._tool_parser.get_remaining_unstreamed_args()


# ---- vLLM: vllm/entrypoints/serve/exception_handling/utils.py (file sha256 723214aa4c63418f1d5eb7c1ff2116eca474778576ac7198daa1f39217c17a4f)
def sanitize_message(message: str) -> str:
    """Strip memory addresses, tracebacks, and file paths from error messages."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(
        r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message
    )
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()




# ---- vLLM: vllm/entrypoints/serve/exception_handling/error_response.py (file sha256 66f9eee71606efaf478aca09e271abeefe952f94f3c2d71dd5d697b121831481)
def create_error_response(
    message: str | Exception,
    err_type: str = "BadRequestError",
    status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> ErrorResponse:
    exc: Exception | None = None

    if isinstance(message, Exception):
        exc = message
        message = str(exc)
        logger.debug(
            "create_error_response called with %s: %s", type(exc).__name__, exc
        )

        from vllm.exceptions import (
            GracefulHTTPError,
            VLLMClientError,
            VLLMNotFoundError,
            VLLMServerError,
            VLLMUnprocessableEntityError,
            VLLMValidationError,
        )
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, GracefulHTTPError):
            err_type = HTTPStatus(exc.http_status).phrase
            status_code = exc.http_status
            param = None
        elif isinstance(exc, VLLMValidationError):
            err_type = "BadRequestError"
            status_code = HTTPStatus.BAD_REQUEST
            param = exc.parameter
        elif isinstance(exc, VLLMUnprocessableEntityError):
            err_type = "UnprocessableEntityError"
            status_code = HTTPStatus.UNPROCESSABLE_ENTITY
            param = exc.parameter
        elif isinstance(exc, VLLMNotFoundError):
            err_type = "NotFoundError"
            status_code = HTTPStatus.NOT_FOUND
            param = None
        elif isinstance(exc, VLLMClientError):
            # Any other client-caused error defaults to 400.
            err_type = "BadRequestError"
            status_code = HTTPStatus.BAD_REQUEST
            param = None
        elif isinstance(exc, GenerationError):
            err_type = (
                "ServiceUnavailableError"
                if isinstance(exc, RetryableRequestError)
                else "InternalServerError"
            )
            status_code = exc.status_code
            param = None
        elif isinstance(exc, EngineDeadError):
            err_type = "InternalServerError"
            status_code = HTTPStatus.INTERNAL_SERVER_ERROR
            param = None
            message = exc.CLIENT_MESSAGE
        elif isinstance(exc, VLLMServerError):
            # Any other server-caused error defaults to 500.
            err_type = "InternalServerError"
            status_code = HTTPStatus.INTERNAL_SERVER_ERROR
            param = None
        # Fallback for raw exceptions not yet migrated to VLLMError.
        # TODO(zqzten): remove these fallback handlers after migration to VLLMError
        elif isinstance(exc, (ValueError, TypeError, OverflowError)):
            err_type = "BadRequestError"
            status_code = HTTPStatus.BAD_REQUEST
            param = None
        elif isinstance(exc, NotImplementedError):
            err_type = "NotImplementedError"
            status_code = HTTPStatus.NOT_IMPLEMENTED
            param = None
        elif any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__):
            # jinja2.TemplateError and its subclasses (avoid importing jinja2)
            err_type = "BadRequestError"
            status_code = HTTPStatus.BAD_REQUEST
            param = None
        else:
            err_type = "InternalServerError"
            status_code = HTTPStatus.INTERNAL_SERVER_ERROR
            param = None

    return ErrorResponse(
        error=ErrorInfo(
            message=sanitize_message(message),
            type=err_type,
            code=status_code.value,
            param=param,
        )
    )




# ---- vLLM: vllm/renderers/online_renderer.py (file sha256 d3bdba4043fcb4f6261526897234034cb8082d0bc67d21a5017857bf61f9ee35), class OnlineRenderer
class OnlineRenderer:  # ours: the class line only
    async def render_chat(
        self,
        request: ChatCompletionRequest,
        *,
        skip_mm_cache: bool = False,
    ) -> tuple[list[ConversationMessage], list[EngineInput]] | ErrorResponse:
        """Core preprocessing logic for chat requests (no model/engine check).

        Called directly by render_chat_request and delegated to by
        OpenAIServingChat.render_chat_request after its engine-aware checks.

        Decode-side token reuse (ids forwarded in ``kv_transfer_params``) is
        handled deeper, in ``preprocess_chat`` / ``_make_request_with_harmony``,
        so it skips only templating and tokenization while tool-choice
        validation and ``adjust_request`` still run and the output is
        detokenized (text-out).
        """
        tokenizer = self.renderer.tokenizer

        tool_parser = self.parser.tool_parser_cls if self.parser is not None else None

        if is_mistral_tokenizer(tokenizer):
            # because of issues with pydantic we need to potentially
            # re-serialize the tool_calls field of the request
            _mt.maybe_serialize_tool_calls(request)  # type: ignore[arg-type]
            _mt.truncate_tool_call_ids(request)  # type: ignore[arg-type]
            _mt.validate_request_params(request)

        # Check if tool parsing is unavailable (common condition)
        tool_parsing_unavailable = (
            tool_parser is None
            and not is_mistral_tokenizer(tokenizer)
            and not self.use_harmony
        )

        # Validate tool_choice when tool parsing is required but unavailable
        if tool_parsing_unavailable and request.tool_choice not in (
            None,
            "none",
        ):
            if request.tool_choice == "auto" and not self.enable_auto_tools:
                # for hf tokenizers, "auto" tools requires
                # --enable-auto-tool-choice and --tool-call-parser
                return self.create_error_response(
                    '"auto" tool choice requires '
                    "--enable-auto-tool-choice and --tool-call-parser to be set"
                )
            elif request.tool_choice != "auto":
                # "required" or named tool requires tool parser
                if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
                    tool_choice_desc = f'function "{request.tool_choice.function.name}"'
                else:
                    tool_choice_desc = f'"{request.tool_choice}"'
                return self.create_error_response(
                    f"tool_choice={tool_choice_desc} requires "
                    "--tool-call-parser to be set"
                )

        if request.tools is None or (
            request.tool_choice == "none" and self.exclude_tools_when_tool_choice_none
        ):
            tool_dicts = None
        else:
            tool_dicts = [tool.model_dump() for tool in request.tools]

        if not self.use_harmony:
            # Common case.
            error_check_ret = self.validate_chat_template(
                request_chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                trust_request_chat_template=self.trust_request_chat_template,
            )
            if error_check_ret is not None:
                return error_check_ret

            conversation, engine_inputs = await self.preprocess_chat(
                request,
                request.messages,
                default_template=self.chat_template,
                default_template_content_format=self.chat_template_content_format,
                default_template_kwargs=self.default_chat_template_kwargs,
                tool_dicts=tool_dicts,
                parser=self.parser,
                skip_mm_cache=skip_mm_cache,
            )
        else:
            # For GPT-OSS.
            self.adjust_harmony_request(request)
            should_include_tools = tool_dicts is not None
            conversation, engine_inputs = self._make_request_with_harmony(
                request, should_include_tools
            )

        return conversation, engine_inputs
    def create_error_response(
        self,
        message: str | Exception,
        err_type: str = "BadRequestError",
        status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
    ) -> ErrorResponse:
        return create_error_response(message, err_type, status_code, param)
    def validate_chat_template(
        self,
        request_chat_template: str | None,
        chat_template_kwargs: dict[str, Any] | None,
        trust_request_chat_template: bool,
    ) -> ErrorResponse | None:
        """Copied from GenerateBaseServing._validate_chat_template."""
        if not trust_request_chat_template and (
            request_chat_template is not None
            or (
                chat_template_kwargs
                and chat_template_kwargs.get("chat_template") is not None
            )
        ):
            return self.create_error_response(
                "Chat template is passed with request, but "
                "--trust-request-chat-template is not set. "
                "Refused request with untrusted chat template."
            )
        return None


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
    def extract_structured_outputs(self) -> StructuredOutputsParams | None:
        """Normalize request constraints into ``StructuredOutputsParams``."""
        return structured_outputs_from_response_format(
            self.structured_outputs,
            self.response_format,
        )

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
    'partial_tag_overlap': 'e4eaa418b1fd56a0b4878c44b3f7d53caea337b7db3b757d449571a59190b680',
    'is_complete_json': '3260b4ef3f302ac3103f8a3d77b9bbbb7d67df04b0c156f8954e3ada9318aa08',
    '_postprocess_messages': '2b8e88dac34c0e96cca7ac2eb909867fe03cd8398cbbf307293455e613e213ea',
    'MASK_64_BITS': '34acf7576716f0658577e45b5d6ebc1bb4f369b8403fdc6057404a25f19cde74',
    'random_uuid': 'ec67b6dae269ff1d6f0842a0c1e5ecfd31a4e58c2e6f5fd12d76e219c8d8c909',
    'make_tool_call_id': 'c768c7aa16c6755c1b246096e7b3744abe66a985ced44e8242fdbaafb3e7fd1a',
    'JsonSchemaResponseFormat': '3716522fee921f3f716041056ed4303c0563f46bf8d458046d3316eee558f782',
    'ResponseFormat': 'c0b0726f3930740e04ed9c417110f8cc5e9e1da7c033bd242120599dc9db5edc',
    'FunctionCall': '958cc8c0a319dc47848feb2d763712a14374d7c4b2925dd6e5236cd20a3e4e4e',
    'ToolCall': '723eac2f8348a969a006872a6890509026a2d3bb3c10c809149a698ced1dbe33',
    'DeltaFunctionCall': 'ba69a8f2821a0269dbf28231cef3e72a5bb330b374a651be3fed85ed68aa0e2e',
    'DeltaToolCall': 'b91fa927a6108fd6213820aba0b541555006feabd31bf1b74a8eedb2e2b9499d',
    'ExtractedToolCallInformation': 'b4de3216e7b9af03921451b2b094adab28292b91f23ed78c9d0bdcee237b11e4',
    'DeltaMessage': '47aa4c2aa162c94c06ca0e60f75f2a092b65b5dda00e58550e34653da8e34889',
    'StructuredOutputsParams': 'd0c18be79bc23dc7d64f653b3dc4c39b54e68a5fd007cb4787490f8d27c78475',
    'get_field': '3a4bb2b8a1dc1ba23cad7cd029a7b96996a016005607d056f39f40351184ec59',
    'is_init_field': '1d255f369cccf091d0131a22528fed3ac88493a2ca962f9334a5587fc052cdf9',
    'replace': 'fe35b2411d2e3e35a6ea4d21909411c94cd67c6922b824796f61946bbf683c27',
    'structured_outputs_from_response_format': '0276e18123ee6087ff18543605d53f8a191f7325f692f5569950a2ef825be03a',
    'ToolStrictLevel': '40b6743bd65972b605411e886df447fc38172182e292b5a01835992b39d473e3',
    'ToolChoice': 'de36b33651bc312334c04ebc974c28a1dc4a32f54ba310511e7f28d5bbc7413f',
    'AllowedToolRef': '7f66f2905e8ebdf0d4d8198db05d3f4db1bf5c347467b2ab8f74bbcac0bc6f59',
    'SimplifiedToolChoice': 'd97694fb1caddd13c4c0bf9fa98763c789cf4be315981c7c7d879a012c474537',
    'StructuralTagBuilder': 'd269e56ab4dccd679316388e86c3a597e4baaa38f85129f185fcef22418ff29d',
    'XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS': '31a715aedbcfd13ba8558717618cc7819c5449ba1b90946f4169231df9a397cf',
    'VLLM_BUILTIN_STRUCTURAL_TAG_MODELS': 'fbbabaea125abe0669cc3520429fe15215f88f5d551773e4833e96ca7d3bd225',
    'SUPPORTED_STRUCTURAL_TAG_MODELS': 'e4aa060032e5d33d0713e2d14555be900442ebcb91039cdf9a2a8fa16fe2dcee',
    '_VLLM_STRUCTURAL_TAG_REGISTRY': '5e62f99428f66b81e1dd7592e8169eeae60740902ed5776c5e679c42a442a871',
    '_BUILTIN_TOOL_STRUCTURAL_TAG_MODELS': 'c0328454be020b119a94d3ab786753723570282e48266fda82dca3152daf6794',
    'register_vllm_structural_tag': '54c746b25283987faecdb576e6a9f9d1aac4b75ef46e920c73a4232961ebf922',
    'get_structural_tag_tools': '38422c1c55f013e3bb037542a61ebf1734af0a21a7843830c8cd0e66dc6c006b',
    '_tool_is_strict': '69e59e81e9f4875fb00bbf4657a4c4b7c3144180b1e8c27ba78694623ad1ad90',
    '_any_tool_strict': 'd7079d555a01f293293ec4978c5b2325f7cb8ea8ab6cefcf0200400fc2fa7633',
    '_with_tool_strict': '18b53b0f569e80145093dedacf55057f55b03945a7bde35ac36faed22c6cc66d',
    'resolve_tool_strictness': 'a62e74e6cbf69feb6bbcf664d309fe6f6b0b6301c6a45bcd0382c880effb510f',
    'get_model_structural_tag': '6f2af3ec73ec2227674efbd79371b8a1fbf840bd5f2e21bf4cfb71b9ab7fa33a',
    '_TOOL_CALL_LIST_FORMATS': '5c313c3ba44713f76db1597c67333aa604be5199573101f2c5bf3928309af8d2',
    'limit_to_single_tool_call': '3aec8a7b0cda74165b02a1f5cd37c680b058f9287ee9b104d06d5f27d04f12c3',
    '_dump_tool_for_xgrammar': '123f13034e85d29d251c68543ed7a79c29389fe6c1cf73259cbb84d2ea3a47a7',
    '_dump_tool_choice_for_xgrammar': '33ff41b1f2486419cf973ac6e4c48225e22884ff44c2dae06d6527909df8e236',
    '_dump_allowed_tool_ref_for_xgrammar': '6dcd334bb1e672e214f939d833ce59c83ca65647735635686ab51a6800e57a6b',
    'get_function_parameters': '6a8026405d380eb422a0e91d1d2733bc221aa0a4ba872622b09af3dc1432ac9d',
    '_hermes_tool_tags': '2a0dadf6c5391d3c7f5d4895c575df60fff16ce037ff3b18e025e3c6733cad4f',
    '_hermes_style_structural_tag': '20b7ec29559e85102b3f67a0798e8034a03fa52097c6863ec87a90cca77b60c2',
    'get_hermes_structural_tag': 'b16e087181d939930174dfa446c8165d2716875db4bde2717ffd5dde3c76af89',
    'ToolParser.supports_required_and_named': 'aba0285e12c255f1aa56b62cd81461381680d956aed01e9ba580f79bc8da88f4',
    'ToolParser.structural_tag_model': '16ecedef2338466349ac1ddae956f3027bcd4c080954724f3cd4f1377f089093',
    'ToolParser.default_tool_strict_level': '3fb211d5de85944ea3c6d78765632f73ed416bba75627cf838ec62b85f243e88',
    'ToolParser.__init_subclass__': 'a4898c9b766ffad0e1412c6ed2f6046e957272cc860191c43cb343d83fbc99e1',
    'ToolParser.__init__': '23480b816400e6ba912ac3639c2f81677e49e2a87a28cfa9787cf05c2f444b23',
    'ToolParser.get_remaining_unstreamed_args': 'ab9f1da5cd24e46cb8e2c25beef391e78152bd46ce3c94a223947735504a31ef',
    'ToolParser.adjust_request': 'e0a6927ae7dde30784fb32495688b8e7e9d2ed4a8c3eaebf66a371cc56c6dc89',
    'ToolParser.get_structural_tag': '95c335d9495bd883e483003cb8025326d47e1052a927095a218cd3398615b4f6',
    'Hermes2ProToolParser.structural_tag_model': '242ffcd7475aa2fe82d65005a3ae9a2d6edd1592c8a086c1a4f0cff401c55ab6',
    'Hermes2ProToolParser.tool_call_start_token': 'f5796d36019dc709e390996a4381d926f9742abca95c22cf60d5d1a9ffec35d4',
    'Hermes2ProToolParser.tool_call_end_token': '769459712fb59df5b362f0df7e0b6dcc6fb213c6b4d30160eaefb915ab960604',
    'Hermes2ProToolParser.tool_call_regex': 'c3003c48ed91bd367420ef64e53cd98e0ad5dfde6c29817f5e4ea8ea1113cb3a',
    'Hermes2ProToolParser.__init__': 'a56b2f1d33925788008da6ac8e4361495157f482ea9f5c1157564576dec3415c',
    'Hermes2ProToolParser.adjust_request': '3a681457845f9d49fea027d51c408b522a87e0c4b0aead35c3269d93176fd2bb',
    'Hermes2ProToolParser.extract_tool_calls': '5bcb34d61aa897d569a13113a68bd3780d45d7e3216fe7aa52b3ef622c554347',
    'Hermes2ProToolParser._extract_content': 'ab4f0c0b49d1948c0673dd50770a40dcc0aebd24b2d8a66bf2484046df24c22e',
    'Hermes2ProToolParser._extract_tool_call_jsons': '28f414a41d92760a4c7137c1341faaced99c750313e1858af7d2f96fc1c8d1de',
    'Hermes2ProToolParser._extract_tool_name': '96f088eb6e7e9541243e60fa78c6643531e8ece6388750c230997de31c215195',
    'Hermes2ProToolParser._extract_tool_args': '08e87e02cccecef43736923795ef25bf1a6905d3335603d7598cca62743428cf',
    'Hermes2ProToolParser._compute_args_diff': 'd67b0af6ddeb443431d5b2a6f748bda46e96fea02b829603be90656223dc9c48',
    'Hermes2ProToolParser.extract_tool_calls_streaming': '86bad2d70015f3d9dfdd621c89d077e3317d29ce22892188ca3ac15e0e77ab22',
    'DelegatingParser._extract_tool_calls': 'cf6ff06342f76b0a21a8e04f7ecbede58635079758a67ed28dcc61be3a3da822',
    'DelegatingParser.adjust_request': 'df97336a2c864a0819e029aa6ce085aa92f26c55999d4ca965d9a895270ca894',
    'DelegatingParser._apply_structural_tag': 'ece2ea203721069de54a0ba49d94db67fb3c351944f60fc657c80a0ec809b3a8',
    'DelegatingParser.extract_tool_calls': 'fecce9bf400d7b68e727df5752521a8862a60581b2a0ace3365b2db36a4af010',
    'DelegatingParser._append_unstreamed_tool_args': 'f7e4d1ea91299e4a78ad778a224cbce1185c5784deacf9c297f6879c315facc7',
    'sanitize_message': 'c4ad34c416e144d8260982cd357e24ed24b288492262fde8ea164a8b48dfa2aa',
    'create_error_response': '86c9ad151aac6c6d0a8ed0e7bd165698f7976a2d71ce92d3601645d55ae4c503',
    'OnlineRenderer.render_chat': '10a5b9c875546044798b2d49ae138ee2ae0ef2f992e93367366af12bff76c1a9',
    'OnlineRenderer.create_error_response': 'aba02a4818eac4000feb74ca3c2d47625a1679985f38e8d7baff6babbb3ac68c',
    'OnlineRenderer.validate_chat_template': 'b8e3edbfeb9478d3a0148412e6a18778e08ceda1ab72fdcfcc741a725c44d17a',
    'ChatCompletionRequest.check_structured_outputs_count': '1a3154a585e4200e954d70984c8e34aee4e6a5601f8f7886a5014ecd960be62e',
    'ChatCompletionRequest.check_tool_usage': '37fbebabbd0008fb62facee3b1b186f835800d6675a29b20826461456238866f',
    'ChatCompletionRequest.extract_structured_outputs': '69e74beeccb42be879f55104ff0fd227a7711f922eb53eda47f6790bc5bd6620',
}
