"""Writes tests/data/vllm_tools_v0_33_0.py: vLLM 0.33.0's own tool-calling functions, copied
verbatim out of the wheel so that tests/gateway/test_http_tools_vllm.py runs them and ours on
the same inputs (vLLM itself needs torch and its whole package to import).

Copied (each by `ast`, its exact source text, whose sha256 is recorded in the output and checked
by the test, so a hand edit of a copy cannot go unnoticed):
- vllm/tool_parsers/utils.py: the JSON schema of `tool_choice: "required"` and of a named
  function (`get_json_schema_from_tools` and its helpers);
- vllm/renderers/chat_utils/chat_message.py: `_postprocess_messages`, which turns an assistant
  turn's tool-call `arguments` into an object for the chat template;
- vllm/tool_parsers/hermes_tool_parser.py: `Hermes2ProToolParser`: `extract_tool_calls`, the
  streaming parser `extract_tool_calls_streaming` with its helpers, `adjust_request`, and the
  class attributes they read; its base `ToolParser` (vllm/tool_parsers/abstract_tool_parser.py:
  `__init_subclass__`, `__init__`, `get_remaining_unstreamed_args`, `adjust_request`), and what
  the streaming parser calls: `partial_tag_overlap`, `is_complete_json` (utils.py),
  `make_tool_call_id` (vllm/renderers/chat_utils/tool_call.py; `random_uuid` from
  vllm/utils/__init__.py), the delta classes (vllm/entrypoints/generate/base/protocol.py),
  and what the serving layer adds to a stream's last delta (vllm/parser/abstract_parser.py:
  `DelegatingParser._append_unstreamed_tool_args`), and how it parses a whole output for a
  tool choice (`DelegatingParser._extract_tool_calls`, `extract_tool_calls`);
- how vLLM constrains a request with tools for a parser that has a structural tag, Hermes's:
  `DelegatingParser.adjust_request` and `_apply_structural_tag` (vllm/parser/abstract_parser.py),
  `ToolParser.get_structural_tag`, `ToolStrictLevel`, and the Hermes tag's builders in
  vllm/tool_parsers/structural_tag_registry.py (they build xgrammar's own StructuralTag; the
  test registers the copy under the registry's module name, which `get_structural_tag` imports
  at call time);
- vllm/sampling_params.py: `StructuredOutputsParams` (it refuses two kinds of constraint), and
  vllm/entrypoints/openai/chat_completion/protocol.py: `ChatCompletionRequest`'s validators
  `check_structured_outputs_count` and `check_tool_usage` (their decorators left out: the test
  calls them as plain functions) and `extract_structured_outputs`, which merges
  `response_format` into `structured_outputs` (`structured_outputs_from_response_format` and the
  response-format classes of vllm/entrypoints/generate/base/protocol.py, vllm/config/utils.py's
  `replace`);
- vllm/renderers/online_renderer.py: `OnlineRenderer.render_chat`, where a server without
  `--tool-call-parser` refuses `tool_choice` other than `none`, and the error it answers
  (`create_error_response`, vllm/entrypoints/serve/exception_handling/).
The lines between the copies (imports and stand-ins for vLLM's pydantic classes and logger) are
ours and marked so.

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm_whl
    mkdir /tmp/vllm_src && cd /tmp/vllm_src && unzip -q /tmp/vllm_whl/vllm-0.33.0-*.whl
    python tests/data/vendor_vllm_tools.py /tmp/vllm_whl/vllm-0.33.0-*.whl /tmp/vllm_src
"""
from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path

UTILS = "vllm/tool_parsers/utils.py"
CHAT_MESSAGE = "vllm/renderers/chat_utils/chat_message.py"
TOOL_CALL = "vllm/renderers/chat_utils/tool_call.py"
VLLM_UTILS = "vllm/utils/__init__.py"
BASE_PROTOCOL = "vllm/entrypoints/generate/base/protocol.py"
CONFIG_UTILS = "vllm/config/utils.py"
ABSTRACT = "vllm/tool_parsers/abstract_tool_parser.py"
STRICT = "vllm/tool_parsers/tool_strict_level.py"
REGISTRY = "vllm/tool_parsers/structural_tag_registry.py"
HERMES = "vllm/tool_parsers/hermes_tool_parser.py"
PARSER = "vllm/parser/abstract_parser.py"
ERROR_UTILS = "vllm/entrypoints/serve/exception_handling/utils.py"
ERROR_RESPONSE = "vllm/entrypoints/serve/exception_handling/error_response.py"
RENDERER = "vllm/renderers/online_renderer.py"
PROTOCOL = "vllm/entrypoints/openai/chat_completion/protocol.py"
SAMPLING = "vllm/sampling_params.py"

# (file, class or None, names) in the order they are written
PIECES = (
    (UTILS, None, ("get_function_tools", "require_function_tools", "_extract_tool_info", "_params_or_empty_object",
                   "_get_tool_schema_from_name_and_params", "_get_tool_schema_from_tool",
                   "_get_tool_schema_defs", "_get_json_schema_from_tools",
                   "get_json_schema_from_tools", "partial_tag_overlap", "is_complete_json")),
    (CHAT_MESSAGE, None, ("_postprocess_messages",)),
    (VLLM_UTILS, None, ("MASK_64_BITS", "random_uuid")),
    (TOOL_CALL, None, ("make_tool_call_id",)),
    (BASE_PROTOCOL, None, ("JsonSchemaResponseFormat", "ResponseFormat", "FunctionCall",
                           "ToolCall", "DeltaFunctionCall", "DeltaToolCall",
                           "ExtractedToolCallInformation", "DeltaMessage")),
    (SAMPLING, None, ("StructuredOutputsParams",)),
    (CONFIG_UTILS, None, ("get_field", "is_init_field", "replace")),
    (BASE_PROTOCOL, None, ("structured_outputs_from_response_format",)),
    (STRICT, None, ("ToolStrictLevel",)),
    (REGISTRY, None, ("ToolChoice", "AllowedToolRef", "SimplifiedToolChoice",
                      "StructuralTagBuilder", "XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS",
                      "VLLM_BUILTIN_STRUCTURAL_TAG_MODELS", "SUPPORTED_STRUCTURAL_TAG_MODELS",
                      "_VLLM_STRUCTURAL_TAG_REGISTRY", "_BUILTIN_TOOL_STRUCTURAL_TAG_MODELS",
                      "register_vllm_structural_tag", "get_structural_tag_tools",
                      "_tool_is_strict", "_any_tool_strict", "_with_tool_strict",
                      "resolve_tool_strictness", "get_model_structural_tag",
                      "_TOOL_CALL_LIST_FORMATS", "limit_to_single_tool_call",
                      "_dump_tool_for_xgrammar", "_dump_tool_choice_for_xgrammar",
                      "_dump_allowed_tool_ref_for_xgrammar", "get_function_parameters",
                      "_hermes_tool_tags", "_hermes_style_structural_tag",
                      "get_hermes_structural_tag")),
    (ABSTRACT, "ToolParser", ("supports_required_and_named", "structural_tag_model",
                              "default_tool_strict_level", "__init_subclass__", "__init__",
                              "get_remaining_unstreamed_args", "adjust_request",
                              "get_structural_tag")),
    (HERMES, "Hermes2ProToolParser", ("structural_tag_model", "tool_call_start_token",
                                      "tool_call_end_token", "tool_call_regex", "__init__",
                                      "adjust_request", "extract_tool_calls", "_extract_content",
                                      "_extract_tool_call_jsons", "_extract_tool_name",
                                      "_extract_tool_args", "_compute_args_diff",
                                      "extract_tool_calls_streaming")),
    (PARSER, "DelegatingParser", ("_extract_tool_calls", "adjust_request",
                                  "_apply_structural_tag", "extract_tool_calls",
                                  "_append_unstreamed_tool_args")),
    (ERROR_UTILS, None, ("sanitize_message",)),
    (ERROR_RESPONSE, None, ("create_error_response",)),
    (RENDERER, "OnlineRenderer", ("render_chat", "create_error_response",
                                  "validate_chat_template")),
    (PROTOCOL, "ChatCompletionRequest", ("check_structured_outputs_count", "check_tool_usage",
                                         "extract_structured_outputs")),
)
# the decorator lines `ast` leaves out of a copied class or method (ours, the same as vLLM's)
DECORATORS = {"StructuredOutputsParams": "@dataclass  # ours: vLLM's decorator (pydantic's)\n",
              "_extract_tool_name": "    @staticmethod  # ours: vLLM's decorator\n",
              "_extract_tool_args": "    @staticmethod  # ours: vLLM's decorator\n",
              "get_hermes_structural_tag":
                  '@register_vllm_structural_tag("hermes")  # ours: vLLM\'s decorator\n'}
# a copied class's base, when it has one (ours: the class line only)
BASES = {"Hermes2ProToolParser": "(ToolParser)"}

PRELUDE = Path(__file__).with_name("vllm_tools_prelude.txt")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def segments(source: str, cls: str | None, names: tuple[str, ...]) -> dict[str, str]:
    """name -> its exact source text (a method or class attribute keeps its indentation)."""
    body = ast.parse(source).body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = {_name(n): " " * n.col_offset + ast.get_source_segment(source, n) for n in body}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"not found: {missing}")
    return {n: found[n] for n in names}


def main(wheel: str, root: str) -> None:
    out = [PRELUDE.read_text().replace("{WHEEL_SHA256}", sha256(Path(wheel).read_bytes()))]
    hashes: dict[str, str] = {}
    for path, cls, names in PIECES:
        source = (Path(root) / path).read_text()
        out.append(f"\n\n# ---- vLLM: {path} (file sha256 {sha256(source.encode())})"
                   + (f", class {cls}" if cls else "") + "\n")
        if cls:
            out.append(f"class {cls}{BASES.get(cls, '')}:  # ours: the class line only\n")
        for name, text in segments(source, cls, names).items():
            key = f"{cls}.{name}" if cls else name
            hashes[key] = sha256(text.encode())
            out.append(DECORATORS.get(name, "") + text + ("\n" if cls else "\n\n\n"))
    out.append("\n# ours: the sha256 of each copied text, as extracted from the wheel\n"
               "VENDORED_SHA256 = {\n"
               + "".join(f"    {k!r}: {v!r},\n" for k, v in hashes.items()) + "}\n")
    dest = Path(__file__).with_name("vllm_tools_v0_33_0.py")
    dest.write_text("".join(out).rstrip() + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
