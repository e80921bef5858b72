"""Incremental detokenization: the streamed deltas add up to decoding the whole output."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from compute_service.engine.detokenize import TextStream
from compute_service.model import ByteTokenizer

TOK = ByteTokenizer()


def stream(ids: list[int]) -> tuple[list[str], str]:
    s, deltas = TextStream(), []
    for n in range(1, len(ids) + 1):
        deltas.append(s.next(TOK, ids[:n]))
    return deltas, s.flush(TOK, ids)


def test_a_multi_byte_character_goes_out_whole_when_its_last_byte_arrives() -> None:
    ids = TOK.encode("a€b")  # € is three bytes
    deltas, rest = stream(ids)
    assert deltas == ["a", "", "", "€", "b"] and rest == ""


def test_an_unfinished_character_is_flushed_as_a_replacement_character() -> None:
    ids = TOK.encode("ok") + TOK.encode("€")[:2]
    deltas, rest = stream(ids)
    assert "".join(deltas) == "ok" and rest == TOK.decode(ids)[2:]
    assert rest.startswith("\ufffd")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 258), max_size=40))
def test_deltas_and_flush_add_up_to_decoding_the_whole_output(ids: list[int]) -> None:
    """Any ids: valid and broken UTF-8, special tokens (skipped) among bytes."""
    deltas, rest = stream(ids)
    assert "".join(deltas) + rest == TOK.decode(ids)
    # Nothing is emitted that a later byte could still change.
    assert not any(d.endswith("\ufffd") for d in deltas)
