"""Chat templates rendered as transformers renders them, in a sandbox, without transformers.

A checkpoint's `chat_template` (tokenizer_config.json, or chat_template.jinja) is Jinja2 code
from whoever published the checkpoint, so it runs in jinja2's `ImmutableSandboxedEnvironment`:
no attribute starting with `_` (an error at once, see `_Sandbox`), no mutation of the values
passed in, no file or module access.
Everything else copies transformers' environment (`utils/chat_template_utils.py`,
`_cached_compile_jinja_template` and `render_jinja_template`), because the worker and the
gateway must produce the very text (hence the very token ids) a model was trained and evaluated
with: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block
that renders its body, the `tojson` filter with `ensure_ascii=False`, the globals
`raise_exception`, `strftime_now`, `dict` and an underscore-refusing `namespace`, and the
variables `messages`, `tools`, `documents`, `add_generation_prompt` and the special-token strings
(`bos_token`, `eos_token`, ...). Messages are copied into plain JSON types first, and keys whose
value is None are dropped, as transformers does (templates test `'key' in message`).

Every failure of a template (its own `raise_exception`, a sandbox refusal, a type error inside
the template) becomes `ChatTemplateError` with the template's message; nothing escapes as
another exception type, so a server can always answer with a clear status.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where transformers reads a message's reasoning from; the first name is what templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer cannot do what was asked of it: bad files, or a chat it cannot render. A
    ValueError, so callers that map ValueError to INVALID_ARGUMENT / HTTP 400 do the right thing
    for the cases that are about the request."""


class NoChatTemplate(TokenizerError):
    """The tokenizer has no chat template: chat messages cannot be turned into a prompt."""


class ChatTemplateError(TokenizerError):
    """The chat template failed on these messages (its own raise_exception, a sandbox refusal,
    an error inside the template); the message says which."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' tracker does
    the same when no assistant mask is asked for; templates that mark assistant turns need the
    tag to parse)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers replaces it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes, got {name!r}")


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, where an unsafe attribute (`''.__class__`) is an error at
    once. jinja2 (and so transformers) gives an undefined value instead, which prints as "" and
    only fails when used further: a template that reaches for internals is refused outright
    here, and no legitimate template renders differently."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


def compile_template(source: str) -> jinja2.Template:
    """The compiled template; ChatTemplateError when it does not parse."""
    try:
        return _ENV.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat_template: does not compile: {exc}") from None


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (strings, numbers, bools, None, lists, dicts), anything
    else replaced by an inert `<TypeName>` placeholder: objects with methods the sandbox does not
    know to be dangerous never reach the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages: must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages: must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}]: must be an object, got "
                                    f"{type(message).__name__}")
        plain = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def render(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
           add_generation_prompt: bool, variables: Mapping[str, str],
           tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """`template` over `messages`, as transformers' `apply_chat_template(tokenize=False)`
    renders it; `variables` are the special-token strings (`bos_token`, ...)."""
    chat = _messages(messages)
    try:
        return template.render(messages=chat, tools=_plain(list(tools)) if tools else None,
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **dict(variables))
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat_template: {exc}") from None
    except Exception as exc:  # the template's own code failed (a type error, a bad index)
        raise ChatTemplateError(f"chat_template: failed on these messages: "
                                f"{type(exc).__name__}: {exc}") from None
