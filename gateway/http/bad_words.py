"""vLLM's `bad_words` as token ids, tokenized by the gateway with the workers' tokenizer as vLLM
tokenizes them (vllm/sampling_params.py, `update_from_tokenizer`): each word as written (left
spaces stripped), and again after a space when that makes a different word of as many tokens
(the form in the middle of a text); the workers ban the last id of each when the output ends
with the others (compute_service/engine/logits_ops.py `bad_word_bans`)."""
from __future__ import annotations

from gateway.core.tokenize import GatewayTokenizer
from gateway.http.errors import bad_request

MAX_BAD_WORDS, MAX_BAD_WORD_IDS = 128, 1024  # vLLM's defaults, the workers' bounds too


def bad_word_ids(words: list[str], tokenizer: GatewayTokenizer) -> list[list[int]]:
    """400 naming `bad_words` for an empty entry, one that tokenizes to nothing, too many, or
    when the gateway knows no tokenizer."""
    tok = tokenizer.current()
    if tok is None:
        raise bad_request("bad_words", "the gateway knows no tokenizer to tokenize them with")
    out: list[list[int]] = []
    for i, word in enumerate(dict.fromkeys(words)):
        if not word:
            raise bad_request("bad_words", f"entry {i} is empty")
        plain = tok.encode(word.lstrip(), add_bos=False)
        if not plain:
            raise bad_request("bad_words", f"entry {i} tokenizes to no token")
        out.append(list(plain))
        spaced = tok.encode(" " + word.lstrip(), add_bos=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    if len(out) > MAX_BAD_WORDS or sum(map(len, out)) > MAX_BAD_WORD_IDS:
        raise bad_request("bad_words", f"at most {MAX_BAD_WORDS} words of "
                                       f"{MAX_BAD_WORD_IDS} tokens in all once tokenized")
    return out
