"""Structured output at the HTTP API: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`) and vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`), checked here and sent to the worker as one `SamplingParams.structured_output`
(the worker compiles it with xgrammar and masks its sampling: compute_service/engine/grammar.py).

- One constraint per request: both fields set, or two kinds in `structured_outputs`, is a 400
  naming the field (vLLM refuses the same).
- A JSON schema is checked against its JSON Schema metaschema here (a 400 naming
  `response_format.json_schema.schema` or `structured_outputs.json`), before any worker call;
  what only the grammar compiler can judge (a regex's or a grammar's syntax, a schema feature
  xgrammar does not take) comes back from the worker as INVALID_ARGUMENT naming
  `sampling.structured_output.<kind>`, which `http_field` maps back to the request's field.
- vLLM's whitespace and structural-tag options are refused by name when set: JSON is always
  generated compact (", " and ": " separators, see grammar.py), and structural tags are not
  implemented.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from gateway.http.errors import bad_request
from prefixcache.v1 import compute_service_pb2 as pb

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options, accepted at their defaults only.
_OPTIONS = {"disable_any_whitespace": (False, True), "disable_additional_properties": (False,),
            "whitespace_pattern": (None,), "structural_tag": (None,),
            "disable_fallback": (False,)}
# The worker's field of each kind -> the constraint kind in the proto.
_PROTO = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}


@dataclass(frozen=True, slots=True)
class Structured:
    """The constraint for the worker and the request field it came from (for errors)."""
    message: pb.StructuredOutput
    field: str


def from_request(response_format: dict[str, Any] | None,
                 structured_outputs: dict[str, Any] | None) -> Structured | None:
    """The request's constraint, or None (plain text). 400 naming the field when it is bad."""
    fmt = from_response_format(response_format)
    so = from_structured_outputs(structured_outputs)
    if fmt is not None and so is not None:
        raise bad_request("structured_outputs", "cannot be combined with a response_format "
                          "other than text: send one constraint")
    return fmt or so


def from_response_format(fmt: dict[str, Any] | None) -> Structured | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(pb.StructuredOutput(json_object=True), "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema", "is required with type "
                              "json_schema: {\"name\": ..., \"schema\": {...}}")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema = any object
        field = "response_format.json_schema.schema"
        return Structured(pb.StructuredOutput(json_schema=_schema_text(schema, field)), field)
    if kind == "structural_tag":
        raise bad_request("response_format.type", "structural_tag is not implemented")
    raise bad_request("response_format.type", "must be text, json_object or json_schema, got "
                      f"{json.dumps(kind)[:64]}")


def from_structured_outputs(so: dict[str, Any] | None) -> Structured | None:
    if so is None:
        return None
    for name, value in so.items():
        if name in _OPTIONS:
            if value not in _OPTIONS[name]:
                raise bad_request(f"structured_outputs.{name}", "is not implemented (JSON is "
                                  "generated compact; structural tags are not served)")
        elif name not in _KINDS:
            raise bad_request(f"structured_outputs.{name}", "is not a field of "
                              "structured_outputs (json, regex, choice, grammar, json_object)")
    set_kinds = [k for k in _KINDS if so.get(k) is not None]
    if len(set_kinds) != 1:
        raise bad_request("structured_outputs", "must set exactly one of json, regex, choice, "
                          f"grammar, json_object (got {', '.join(set_kinds) or 'none'})")
    kind = set_kinds[0]
    value, field = so[kind], f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(field, f"is not valid JSON ({exc})") from None
        return Structured(pb.StructuredOutput(json_schema=_schema_text(value, field)), field)
    if kind == "json_object":
        if value is not True:
            raise bad_request(field, "must be true when set")
        return Structured(pb.StructuredOutput(json_object=True), field)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(field, "must be a non-empty list of non-empty strings")
        return Structured(pb.StructuredOutput(choice=pb.Choices(values=value)), field)
    if not isinstance(value, str) or not value:
        raise bad_request(field, "must be a non-empty string")
    return Structured(pb.StructuredOutput(**{_PROTO[kind]: value}), field)


def _schema_text(schema: Any, field: str) -> str:
    """The schema as JSON text, once it is an object that its metaschema accepts."""
    if not isinstance(schema, dict):
        raise bad_request(field, "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise bad_request(field, f"is not a valid JSON Schema ({exc.message}"
                          f"{' at ' + where if where else ''})") from None
    return json.dumps(schema)


def http_field(message: str, structured: Structured | None) -> tuple[str, str] | None:
    """(request field, message) of a worker's INVALID_ARGUMENT about the constraint, else
    None."""
    if structured is None or not message.startswith("sampling.structured_output"):
        return None
    return structured.field, message.split(": ", 1)[-1]
