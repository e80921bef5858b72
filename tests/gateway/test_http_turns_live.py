"""Token-exact chat turns end to end (gateway/http/turns.py): `python -m gateway` with
`--http-turn-memory-tokens` in front of two real tiny-hybrid workers over a checkpoint with the
demo's ChatML template (conftest.chat_checkpoint). A conversation's next turn, the answer sent
back as text, is served from cache through the whole history: the previous prompt and every
page of the generated answer, streamed or whole."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.gateway.conftest import chat_checkpoint
from tests.gateway.http_helpers import post, stream
from tests.gateway.live_stack import PAGE, LiveStacks


@pytest.fixture(scope="module")
def stack():
    stacks = LiveStacks(model=chat_checkpoint, gateway_args=(
        "--tokenizer", "{model}", "--http-turn-memory-tokens", "100000"))
    try:
        yield stacks.get()
    finally:
        stacks.close()


def history_pages(usage: dict) -> int:
    """The previous turn's prompt and answer in whole pages: what a worker holds of them (the
    last generated token is sampled, never computed)."""
    return (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // PAGE * PAGE


# The random model's answers constrained to one of two texts (vLLM's structured_outputs choice):
# no spaces at their ends, which the demo template would trim (an answer it does not write
# verbatim is not spliced), and their ids generated under the grammar, not the text's encoding.
ANSWERS = {"choice": ["the quick brown fox jumps over the lazy dog",
                      "hello world, the cache never computes the same prompt twice"]}


def first_turn(stack, model: str) -> tuple[list[dict], dict]:
    chat = [{"role": "user", "content": f"hello {uuid.uuid4().hex[:8]} the river"}]
    body = post(stack.http_url, "/v1/chat/completions", {
        "model": model, "messages": chat, "max_tokens": 64, "temperature": 0,
        "structured_outputs": ANSWERS}).json()
    answer = body["choices"][0]["message"]["content"]
    # The tiny checkpoint's EOS id (its preset's) is a plain token of this tokenizer: the
    # worker sends it as text, and the client sends it back.
    assert any(answer.startswith(a) for a in ANSWERS["choice"]), body
    return chat + [{"role": "assistant", "content": answer}], body["usage"]


def test_next_turns_reuse_the_whole_history_whole_and_streamed(stack):
    model = Path(stack.model).name
    chat, usage = first_turn(stack, model)
    chat.append({"role": "user", "content": "and the mountain?"})
    events = stream(stack.http_url, "/v1/chat/completions", {
        "model": model, "messages": chat, "max_tokens": 64, "temperature": 0,
        # Another answer than the first: the memory keeps one id sequence per text.
        "structured_outputs": {"choice": [a for a in ANSWERS["choice"]
                                          if not chat[1]["content"].startswith(a)]},
        "stream_options": {"include_usage": True}})
    second = events[-2]["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= history_pages(usage) > 0
    answer = "".join(c["delta"].get("content") or "" for e in events[:-2]
                     for c in e["choices"])
    chat += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "thanks"}]
    third = post(stack.http_url, "/v1/chat/completions", {
        "model": model, "messages": chat, "max_tokens": 4, "temperature": 0}).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] >= history_pages(second)


def test_another_tenant_is_not_given_the_remembered_ids(stack):
    """Tenant B sending A's conversation gets the fresh encoding: its prompt is what the
    gateway's /tokenize of the same messages says (A's is the spliced one)."""
    model = Path(stack.model).name
    chat, _ = first_turn(stack, model)
    chat.append({"role": "user", "content": "and then?"})
    body = {"model": model, "messages": chat, "max_tokens": 1, "temperature": 0}
    fresh = post(stack.http_url, "/tokenize", {"model": model, "messages": chat}).json()
    b = post(stack.http_url, "/v1/chat/completions", body, token="tok-b").json()["usage"]
    a = post(stack.http_url, "/v1/chat/completions", body).json()["usage"]
    assert b["prompt_tokens"] == fresh["count"] != a["prompt_tokens"]
