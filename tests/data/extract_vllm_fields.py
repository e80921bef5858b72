"""Extracts the request field names of vLLM's OpenAI protocol classes into
tests/data/vllm_openai_fields_v0_33_0.json (read by tests/gateway/test_http_vllm_fields.py).

Provenance: vLLM 0.33.0 (Apache-2.0), the wheel `pip download vllm==0.33.0 --no-deps`, files
vllm/entrypoints/openai/chat_completion/protocol.py (ChatCompletionRequest),
vllm/entrypoints/openai/completion/protocol.py (CompletionRequest),
vllm/entrypoints/serve/tokenize/protocol.py (TokenizeCompletionRequest, TokenizeChatRequest,
DetokenizeRequest). Only the names are taken (the class bodies' annotated assignments, read with
`ast`, so vLLM need not be importable).

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
    dest = Path(__file__).with_name("vllm_openai_fields_v0_33_0.json")
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
