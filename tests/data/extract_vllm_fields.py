"""Extracts the request field names of vLLM's OpenAI protocol classes into
tests/data/vllm_openai_fields_v0_33_0.json (read by tests/gateway/test_http_vllm_fields.py).

Provenance: vLLM 0.33.0 (Apache-2.0), the wheel `pip download vllm==0.33.0 --no-deps`, files
vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest),
vllm/entrypoints/openai/completion/protocol.py (CompletionRequest),
vllm/entrypoints/serve/tokenize/protocol.py (TokenizeCompletionRequest, TokenizeChatRequest,
DetokenizeRequest); and the HTTP endpoints (method, path) of the api_router.py files under
vllm/entrypoints/openai/ and vllm/entrypoints/serve/{tokenize,sagemaker}/ and of
vllm/entrypoints/serve/instrumentator/{basic,health}.py (ROUTE_FILES). Only the names are taken
(class bodies' annotated assignments and `@router.get/post(...)` decorators, read with `ast`,
so vLLM need not be importable).

    python tests/data/extract_vllm_fields.py /tmp/vllm_src   # the unzipped wheel
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

CLASSES = {
    "chat": ("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
    "completion": ("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"),
    "tokenize_completion": ("vllm/entrypoints/serve/tokenize/protocol.py",
                            "TokenizeCompletionRequest"),
    "tokenize_chat": ("vllm/entrypoints/serve/tokenize/protocol.py", "TokenizeChatRequest"),
    "detokenize": ("vllm/entrypoints/serve/tokenize/protocol.py", "DetokenizeRequest"),
}


ROUTE_FILES = ("vllm/entrypoints/openai/*/api_router.py",
               "vllm/entrypoints/serve/tokenize/api_router.py",
               "vllm/entrypoints/serve/sagemaker/api_router.py",
               "vllm/entrypoints/serve/instrumentator/basic.py",
               "vllm/entrypoints/serve/instrumentator/health.py")


def routes(source: str) -> list[tuple[str, str]]:
    """(METHOD, path) of every `@router.<method>("path", ...)` decorator, nested ones too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and isinstance(d.func.value, ast.Name) and d.func.value.id == "router"
                    and d.func.attr in ("get", "post", "put", "delete") and d.args
                    and isinstance(d.args[0], ast.Constant)):
                out.append((d.func.attr.upper(), d.args[0].value))
    return out


def fields(source: str, name: str) -> list[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and not s.target.id.startswith("_")]
    raise SystemExit(f"class {name} not found")


def main(root: str) -> None:
    out = {"source": "vllm 0.33.0 wheel (Apache-2.0)",
           "files": {k: f"{path}:{cls}" for k, (path, cls) in CLASSES.items()}}
    for key, (path, cls) in CLASSES.items():
        out[key] = fields((Path(root) / path).read_text(), cls)
    out["endpoints"] = sorted({(m, p) for pattern in ROUTE_FILES
                               for f in sorted(Path(root).glob(pattern))
                               for m, p in routes(f.read_text())})
    dest = Path(__file__).with_name("vllm_openai_fields_v0_33_0.json")
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
