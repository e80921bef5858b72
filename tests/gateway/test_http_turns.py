"""Token-exact chat turns (gateway/http/turns.py): the splice of remembered answer ids into a
chat's prompt, and the memory's bounds (tokens, time) and tenant isolation. On the demo's real
byte-level BPE tokenizer with its ChatML template (tests/data/bpe_tokenizer)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.http.turns import (TurnMemory, TurnMemoryConfig, answer_ids, namespace,
                                remember_answers, remembered_answers, spliced_chat_ids)
from prefixcache_client.tokenizer import from_directory
from tests.gateway.conftest import BPE_TOKENIZER

ANSWER = "the cache page prefix token worker"


@pytest.fixture(scope="module")
def tok():
    return from_directory(BPE_TOKENIZER)


def generated(tok, text: str) -> list[int]:
    """Ids that decode to `text` but are not its encoding: one id per character, as a model
    may generate them."""
    ids = [i for ch in text for i in tok.encode(ch)]
    assert tok.decode(ids) == text and ids != tok.encode(text)
    return ids


def chat(answer: str = ANSWER) -> list[dict]:
    return [{"role": "user", "content": "hello world"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and the river?"}]


def test_remembered_ids_are_spliced_in_place_of_the_reencoded_answer(tok):
    ids = generated(tok, ANSWER)
    spliced = spliced_chat_ids(tok, chat(), {1: ids})
    first_turn = tok.chat_ids(chat()[:1])  # the previous request's prompt
    # The new prompt is the previous prompt + the generated answer, then the rest: all of the
    # history is a prefix the worker computed already.
    assert spliced[:len(first_turn) + len(ids)] == first_turn + ids
    plain = tok.chat_ids(chat())
    assert spliced != plain and plain[:len(first_turn)] == first_turn
    assert tok.decode(spliced, skip_special_tokens=False) == tok.render_chat(chat())


def test_splicing_the_encoding_itself_changes_nothing(tok):
    """Special tokens around the content: encoding the pieces apart is the fresh encoding."""
    assert spliced_chat_ids(tok, chat(), {1: tok.encode(ANSWER)}) == tok.chat_ids(chat())


def test_a_template_that_rewrites_the_content_is_not_spliced(tok):
    """The demo template trims contents: an answer with surrounding spaces is not written
    verbatim, so the splice refuses and the caller re-encodes."""
    padded = "  " + ANSWER + "\n"
    assert spliced_chat_ids(tok, chat(padded), {1: generated(tok, padded)}) is None
    assert spliced_chat_ids(tok, chat(), {}) is None


def test_answer_ids_keep_only_what_round_trips(tok):
    ids = generated(tok, ANSWER)
    assert answer_ids(tok, ANSWER, ids + list(tok.eos_token_ids)) == ids
    assert answer_ids(tok, ANSWER[:-3], ids) is None  # a stop string's cut: text != ids
    assert answer_ids(tok, "", []) is None


def test_memory_isolates_tenants_and_salts():
    memory = TurnMemory(TurnMemoryConfig(max_tokens=100))
    a, b = namespace("a", "sa", "fp"), namespace("b", "sb", "fp")
    memory.remember(a, ANSWER, [1, 2, 3])
    assert memory.recall(a, ANSWER) == (1, 2, 3)
    assert memory.recall(b, ANSWER) is None  # tenant B never gets tenant A's ids
    assert memory.recall(namespace("a", "cs-other", "fp"), ANSWER) is None  # another cache_salt
    assert memory.recall(namespace("a", "sa", "other-tokenizer"), ANSWER) is None
    messages = chat()
    assert remembered_answers(memory, b, messages) == {}
    assert remembered_answers(memory, a, messages) == {1: (1, 2, 3)}


def test_memory_is_bounded_by_tokens_least_recently_used_first():
    memory = TurnMemory(TurnMemoryConfig(max_tokens=10))
    for k in range(3):
        memory.remember("t", f"answer {k}", [k] * 4)
    assert memory.tokens == 8 and len(memory) == 2 and memory.dropped == 1
    assert memory.recall("t", "answer 0") is None
    memory.recall("t", "answer 1")  # now the most recent
    memory.remember("t", "answer 3", [3] * 4)
    assert memory.recall("t", "answer 2") is None and memory.recall("t", "answer 1") == (1,) * 4
    memory.remember("t", "too long", [9] * 11)  # over the whole budget: not stored
    assert memory.recall("t", "too long") is None and memory.tokens <= 10


def test_memory_expires_after_its_ttl_since_last_use():
    now = [0.0]
    memory = TurnMemory(TurnMemoryConfig(max_tokens=100, ttl_s=10.0), clock=lambda: now[0])
    memory.remember("t", "x", [1])
    now[0] = 9.0
    assert memory.recall("t", "x") == (1,)  # used: kept 10 s more
    now[0] = 18.0
    assert memory.recall("t", "x") == (1,)
    now[0] = 28.5
    assert memory.recall("t", "x") is None and memory.tokens == 0


def test_memory_off_remembers_nothing():
    memory = TurnMemory(TurnMemoryConfig())
    memory.remember("t", "x", [1])
    assert not memory.enabled and memory.recall("t", "x") is None and len(memory) == 0


def test_remember_answers_takes_finished_choices_only(tok):
    memory = TurnMemory(TurnMemoryConfig(max_tokens=1000))
    ids = generated(tok, ANSWER)

    def sample(text, finish, stats=object()):
        return SimpleNamespace(text=[text], ids=ids, finish=finish, stats=stats)
    samples = [sample(ANSWER, "stop"), sample("other", "stop"),  # ids do not decode to it
               sample(ANSWER + " ", None, None)]  # not ended
    assert remember_answers(memory, "t", tok, samples) == 1
    assert memory.recall("t", ANSWER) == tuple(ids)
