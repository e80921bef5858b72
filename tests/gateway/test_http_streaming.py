"""Stop strings cut a streamed text exactly, whatever its chunking, and never show part of a stop
string; multi-byte characters come through whole; the SSE chunks have OpenAI's shapes."""
from __future__ import annotations

import asyncio
import json

import pytest

from gateway.http.generation import Job, Sample
from gateway.http.choices import Choices
from gateway.http.logprobs import TokenNames
from gateway.http.streaming import StopMatcher, sse_events
from prefixcache.v1 import compute_service_pb2 as pb


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """The releases of a matcher fed `deltas` (and flushed when nothing matched)."""
    m = StopMatcher(stops)
    out = [m.feed(d) for d in deltas]
    if not m.matched:
        out.append(m.flush())
    return out, m.matched


def expected(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


CASES = [
    # (stops, deltas)
    (["STOP"], ["hello ", "wor", "ld"]),                    # no stop: everything, in the end
    (["STOP"], ["hello ST", "OP and more"]),                # split across chunks
    (["STOP"], ["hello S", "T", "O", "P", "tail"]),         # one character at a time
    (["STOP"], ["hello STO", "NE STOP"]),                   # a false start, then the real one
    (["STOP"], ["hello STOPSTOP"]),                         # first occurrence wins
    (["ab", "b"], ["xa", "b"]),                             # earliest start across stops
    (["b", "ab"], ["xa", "by"]),
    (["\n\n", "###"], ["line\n", "\nnext"]),
    (["é!"], ["caf", "é", "!", " then"]),                   # multi-byte characters
    (["→"], ["a ", "→", " b"]),
    (["日本"], ["こんにちは日", "本語"]),
    (["🙂x"], ["ok 🙂", "y 🙂", "x end"]),                  # a 4-byte character, false start
    (["end"], ["", "the e", "", "nd"]),                     # empty deltas (a held-back char)
    ([], ["no ", "stops"]),
    (["aaa"], ["aa", "aa", "a"]),                           # overlapping partial matches
    (["STOP"], ["ST"]),                                     # ends on a partial match: shown
]


@pytest.mark.parametrize("stops,deltas", CASES)
def test_stop_strings_cut_exactly_whatever_the_chunking(stops, deltas):
    text = "".join(deltas)
    want, matched = expected(stops, text)
    out, got_matched = run(stops, deltas)
    assert "".join(out) == want and got_matched == matched
    # The same cut when the text arrives whole, or one character at a time.
    assert "".join(run(stops, [text])[0]) == want
    assert "".join(run(stops, list(text))[0]) == want
    # No release ever ends in a proper prefix of a stop string that the text then completes:
    # what was shown is always a prefix of the final answer.
    shown = ""
    m = StopMatcher(stops)
    for d in deltas:
        shown += m.feed(d)
        assert want.startswith(shown)
        for s in stops:
            assert s not in shown


class OneFindPerStop:
    """The matcher as it was (one `find` and one `startswith` per stop string per delta): the
    new one must release exactly what it released, delta by delta."""

    def __init__(self, stops):
        self.stops, self.held, self.matched = list(stops), "", False

    def feed(self, text):
        if self.matched:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self.held = True, ""
            return buf[:min(hits)]
        keep = 0
        for k in range(min(max(map(len, self.stops)) - 1, len(buf)), 0, -1):
            if any(s.startswith(buf[len(buf) - k:]) for s in self.stops):
                keep = k
                break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]


def test_many_stop_strings_release_what_one_find_per_stop_released():
    """16 stop strings (the limit) over a small alphabet, so that they overlap, share prefixes,
    contain one another and span delta boundaries; random texts cut into random deltas."""
    import random

    from prefixcache_client.limits import MAX_STOP_STRINGS
    rng = random.Random(7)
    for _ in range(300):
        stops = list({"".join(rng.choice("abc.é") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, MAX_STOP_STRINGS))})
        text = "".join(rng.choice("abcd.é ") for _ in range(rng.randint(0, 60)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        new, old = StopMatcher(stops), OneFindPerStop(stops)
        for d in deltas:
            assert new.feed(d) == old.feed(d), (stops, deltas)
            assert new.matched == old.matched
        assert new.flush() == ("" if old.matched else old.held)
        assert "".join(run(stops, deltas)[0]) == expected(stops, text)[0]


def test_nothing_is_released_after_a_match():
    m = StopMatcher(["X"])
    assert m.feed("abXcd") == "ab" and m.matched
    assert m.feed("more") == "" and m.flush() == ""


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def _msg(text: str, ids: list[int], stats: pb.GenerateStats | None = None):
    msg = pb.GenerateResponse(token_ids=ids, text=text)
    if stats is not None:
        msg.stats.CopyFrom(stats)
    return msg


def test_a_sample_keeps_multibyte_characters_whole_and_counts_tokens():
    # The worker holds back an incomplete UTF-8 character (an empty text delta) and sends it
    # whole with the token that completes it: "é" is two byte tokens.
    sample = Sample(Job(0, 0, pb.GenerateRequest()), StopMatcher(["!"]))
    seen = []
    for msg in (_msg("caf", [99, 97, 102]), _msg("", [0xC3]), _msg("é", [0xA9]),
                _msg("!x", [33, 120]),
                _msg("", [], pb.GenerateStats(finish_reason=pb.FINISH_REASON_ABORT,
                                              prompt_tokens=5, computed_prompt_tokens=5))):
        seen.append(sample.feed(msg))
    assert seen == [("caf", False), ("", False), ("é", False), ("", True), ("", False)]
    assert "".join(sample.text) == "café" and sample.finish == "stop"
    # Tokens up to the message that completed the stop string; the abort's tail is not counted.
    assert sample.tokens == 7 and sample.stats.prompt_tokens == 5


@pytest.mark.parametrize("reason,word", [(pb.FINISH_REASON_STOP, "stop"),
                                         (pb.FINISH_REASON_LENGTH, "length")])
def test_a_sample_finishes_with_the_workers_reason(reason, word):
    sample = Sample(Job(0, 0, pb.GenerateRequest()), StopMatcher(["zz"]))
    assert sample.feed(_msg("ab z", [1, 2])) == ("ab ", False)  # "z" held back
    assert sample.feed(_msg("", [], pb.GenerateStats(finish_reason=reason))) == ("z", True)
    assert sample.finish == word and "".join(sample.text) == "ab z"


class _FakeGeneration:
    """What sse_events reads: samples, events(), close()."""

    def __init__(self, events):
        self.samples = [Sample(Job(i, 0, pb.GenerateRequest()), StopMatcher([]))
                        for i in range(2)]
        self._events, self.closed = events, False

    async def events(self):
        for index, delta, finish in self._events:
            sample = self.samples[index]
            sample.finish = finish
            yield sample, delta, finish is not None

    def close(self):
        self.closed = True


async def _collect(gen, chat: bool, include_usage: bool, shape: Choices | None = None) -> list:
    out = []
    async for event in sse_events(gen, shape or Choices(chat), "id-1", 7, "m", include_usage,
                                  lambda: {"prompt_tokens": 1}):
        out.append(event["data"])
    return out


def test_chat_chunks_open_with_the_role_and_end_with_usage_and_done():
    gen = _FakeGeneration([(0, "he", None), (1, "yo", None), (0, "llo", "stop"),
                           (1, "", "length")])
    data = asyncio.run(_collect(gen, chat=True, include_usage=True))
    assert data[-1] == "[DONE]" and gen.closed
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "id-1" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"],
               c["choices"][0]["finish_reason"]) for c in chunks[2:-1]]
    assert deltas == [(0, {"content": "he"}, None), (1, {"content": "yo"}, None),
                      (0, {"content": "llo"}, "stop"), (1, {}, "length")]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 1}


def test_completion_chunks_without_usage():
    gen = _FakeGeneration([(0, "a", None), (0, "b", "stop")])
    data = asyncio.run(_collect(gen, chat=False, include_usage=False))
    chunks = [json.loads(d) for d in data[:-1]]
    assert data[-1] == "[DONE]" and all("usage" not in c for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "b", "logprobs": None, "finish_reason": "stop"}]]
    assert all(c["object"] == "text_completion" for c in chunks)


def _lp(logprob: float, *top: tuple[int, float]) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=logprob, top_ids=[t for t, _ in top],
                            top_logprobs=[v for _, v in top])


def test_streamed_logprobs_ride_with_their_tokens_in_both_shapes():
    """A message's tokens' logprobs go in the chunk of that message, also when its text is held
    back (a chunk with logprobs and no content); completions count text_offset across chunks,
    after the echoed prompt."""
    letters = {1: "a", 2: "b", 3: "c"}

    class Letters:  # a tokenizer of three one-letter tokens
        def decode(self, ids, skip_special_tokens=True):
            return "".join(letters[t] for t in ids)

        def token_bytes(self, t):
            return letters[t].encode()

    name = TokenNames(Letters())

    def run(chat: bool, echo=None):
        gen = _FakeGeneration([])
        s = gen.samples[0]
        s.fresh = [(1, _lp(-0.5, (1, -0.5), (3, -1.5)))]
        gen._events = [(0, "a", None)]
        out = asyncio.run(_collect(gen, chat, False, Choices(chat, 1, name, echo)))
        return [json.loads(d) for d in out[:-1]]

    chat = run(True)[-1]["choices"][0]
    assert chat["logprobs"] == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "c", "logprob": -1.5, "bytes": [99]}]}]}
    chunks = run(False, echo=["PR"])
    assert chunks[0]["choices"][0]["text"] == "PR"
    assert chunks[-1]["choices"][0]["logprobs"] == {
        "tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "c": -1.5}],
        "text_offset": [2]}
