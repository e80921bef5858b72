"""The shared tokenizer (prefixcache_client.tokenizer) against transformers on the same files: chat
templates rendered alike (sandboxed), chat and text ids alike, fingerprints that identify the
files, and the byte-level tokenizer of the presets."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from prefixcache_client.tokenizer import (BYTE_TOKENIZER_FILE, ByteTokenizer, ChatTemplateError,
                                          JsonTokenizer, NoChatTemplate, TokenizerError,
                                          fingerprint_of, from_directory, from_files,
                                          tokenizer_files)

BPE = Path(__file__).resolve().parents[1] / "data" / "bpe_tokenizer"

# Templates beside the shipped ChatML one, each exercising what transformers' environment adds.
LLAMA3 = (  # bos_token, strip, loop.first, a default system prompt
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]"
    "['content'] %}{% set messages = messages[1:] %}{% else %}{% set system = 'Be kind.' %}"
    "{% endif %}<|im_start|>system\n\n{{ system | trim }}<|im_end|>"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n\n"
    "{{ message['content'] | trim }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")
FEATURES = (  # namespace, loop controls, tojson, the generation tag, eos_token, trim/lstrip
    "{% set ns = namespace(turns=0) %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "    {% set ns.turns = ns.turns + 1 %}\n"
    "    {% if ns.turns > 3 %}{% break %}{% endif %}\n"
    "    {% if message['role'] == 'assistant' %}\n"
    "<|im_start|>assistant {% generation %}{{ message['content'] }}{% endgeneration %}"
    "{{ eos_token }}\n"
    "    {% else %}\n"
    "<|im_start|>{{ message['role'] }} {{ message | tojson }}<|im_end|>\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
TEMPLATES = {"chatml": None, "llama3": LLAMA3, "features": FEATURES}

CHATS = {
    "user": [{"role": "user", "content": "hello world"}],
    "system-user": [{"role": "system", "content": "You are a small model."},
                    {"role": "user", "content": "Which river is the longest?"}],
    "multi-turn": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "hello"},
                   {"role": "assistant", "content": "  the quick brown fox  "},
                   {"role": "user", "content": "and the lazy dog?"},
                   {"role": "assistant", "content": "jumps over"},
                   {"role": "user", "content": "again"}],
    "unicode": [{"role": "user", "content": "héllo naïve über 日本 🙂 \"quoted\" <b>"},
                {"role": "assistant", "content": "ok"}],
    "none-field": [{"role": "user", "content": "x", "name": None}],
    "special-in-text": [{"role": "user", "content": "fake <|im_end|> <|im_start|>system"}],
}
TEXTS = ["hello world", "", " leading space", "Héllo naïve 日本 🙂\n\ttabs",
         "the cache page <|im_start|> prefix <|bos|>", "999 + 1 = 1000!?"]


def _variant(tmp_path: Path, template: str | None, *, post_processor: bool = True) -> Path:
    """The shipped tokenizer with another chat template and/or no post-processor."""
    out = tmp_path / "tok"
    out.mkdir(exist_ok=True)
    config = json.loads((BPE / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    tok = json.loads((BPE / "tokenizer.json").read_text())
    if not post_processor:
        tok["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


@functools.cache
def _hf(path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=list(TEMPLATES))
def template_dir(request, tmp_path) -> Path:
    template = TEMPLATES[request.param]
    return BPE if template is None else _variant(tmp_path, template)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", list(CHATS))
def test_chats_render_and_tokenize_as_transformers(template_dir, chat, add_generation_prompt):
    ours, hf = from_directory(template_dir), _hf(str(template_dir))
    messages = CHATS[chat]
    text = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt) == text
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                 add_generation_prompt=add_generation_prompt)
    assert ours.chat_ids(messages, add_generation_prompt) == list(ids)


@pytest.mark.parametrize("post_processor", [True, False], ids=["bos-post-processor", "none"])
@pytest.mark.parametrize("text", TEXTS)
def test_text_prompts_and_round_trips_match_transformers(tmp_path, text, post_processor):
    path = _variant(tmp_path, None, post_processor=post_processor)
    ours, hf = from_directory(path), _hf(str(path))
    assert ours.adds_bos is post_processor
    assert ours.text_prompt_ids(text) == hf(text)["input_ids"]
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.decode(ours.text_prompt_ids(text)) == hf.decode(hf(text)["input_ids"],
                                                                skip_special_tokens=True)


@pytest.mark.parametrize("post_processor", [True, False], ids=["bos-post-processor", "none"])
def test_the_tokenizer_not_config_json_decides_a_texts_bos(tmp_path, post_processor):
    """config.json's bos_token_id disagreeing with the tokenizer (a preset's 257 beside these
    files): text ids are still transformers' tokenizer(text), which never reads config.json."""
    path = _variant(tmp_path, None, post_processor=post_processor)
    (path / "config.json").write_text(json.dumps({"bos_token_id": 257, "eos_token_id": 258}))
    tok = from_directory(path)
    assert (tok.bos_token_id, tok.adds_bos, tok.eos_token_ids) == (0, post_processor, (258,))
    assert tok.text_prompt_ids(TEXTS[3]) == _hf(str(path))(TEXTS[3])["input_ids"]


def test_the_workers_tokenizer_is_this_one(tmp_path):
    pytest.importorskip("torch")
    from compute_service.model import load_tokenizer, preset_config

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BPE / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 3}))
    worker = load_tokenizer(tmp_path, preset_config("tiny-transformer"))
    ours = from_files(tokenizer_files(tmp_path))
    assert worker.fingerprint == ours.fingerprint
    for text in TEXTS:
        assert worker.text_prompt_ids(text) == ours.text_prompt_ids(text)
    assert worker.chat_ids(CHATS["multi-turn"]) == ours.chat_ids(CHATS["multi-turn"])


@pytest.mark.parametrize("make", [lambda: from_directory(BPE), ByteTokenizer],
                         ids=["bpe", "byte"])
def test_from_files_rebuilds_the_same_tokenizer(make):
    tok = make()
    again = from_files(tok.files)
    assert type(again) is type(tok) and again.fingerprint == tok.fingerprint
    assert again.files == tok.files
    for text in TEXTS:
        assert again.text_prompt_ids(text) == tok.text_prompt_ids(text)
    assert (again.bos_token_id, again.eos_token_ids, again.vocab_size) == (
        tok.bos_token_id, tok.eos_token_ids, tok.vocab_size)


def test_configs_count_by_their_token_ids_only(tmp_path):
    path = _variant(tmp_path, None)
    (path / "config.json").write_text(json.dumps({"eos_token_id": [3, 1], "hidden_size": 64}))
    first = from_directory(path)
    assert first.eos_token_ids == (3, 1)
    # Another model with this tokenizer (other weights, same ids): the same fingerprint.
    (path / "config.json").write_text('{"hidden_size": 128,\n "eos_token_id": [3, 1]}')
    assert from_directory(path).fingerprint == first.fingerprint
    (path / "config.json").write_text(json.dumps({"eos_token_id": [3]}))
    assert from_directory(path).fingerprint != first.fingerprint


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
@pytest.mark.parametrize("where", [0, 0.5, -1])
def test_any_changed_byte_changes_the_fingerprint(name, where):
    files = dict(from_directory(BPE).files, **{"config.json": b'{"eos_token_id":3}'})
    content = bytearray(files[name])
    i = int(where * (len(content) - 1)) if where >= 0 else len(content) - 1
    content[i] ^= 0x01
    assert fingerprint_of({**files, name: bytes(content)}, 0) != fingerprint_of(files, 0)
    assert fingerprint_of(files, 0) != fingerprint_of(files, None)  # the BOS rule counts too


def test_the_chat_template_file_wins_and_changes_the_fingerprint(tmp_path):
    path = _variant(tmp_path, None)
    before = from_directory(path)
    (path / "chat_template.jinja").write_text(LLAMA3)
    after = from_directory(path)
    assert after.chat_template == LLAMA3 and after.fingerprint != before.fingerprint
    assert after.render_chat(CHATS["user"]) == _hf(str(path)).apply_chat_template(
        CHATS["user"], tokenize=False, add_generation_prompt=True)


def test_byte_tokenizer_is_a_constant_with_its_own_fingerprint():
    byte, bpe = ByteTokenizer(), from_directory(BPE)
    assert byte.fingerprint == ByteTokenizer().fingerprint != bpe.fingerprint
    assert list(byte.files) == [BYTE_TOKENIZER_FILE]
    text = "héllo, wörld — 你好 🙂"
    assert byte.decode(byte.text_prompt_ids(text)) == text
    assert byte.text_prompt_ids(text)[0] == ByteTokenizer.BOS
    with pytest.raises(TokenizerError, match=BYTE_TOKENIZER_FILE):
        from_files({BYTE_TOKENIZER_FILE: b'{"type": "prefixcache-byte", "version": 2}'})


def test_bad_files_are_refused_naming_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        from_files({"tokenizer.json": b"{not json"})
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        from_files({"config.json": b'{"eos_token_id": 1}'})
    with pytest.raises(TokenizerError, match="'model.safetensors'"):
        from_files({**from_directory(BPE).files, "model.safetensors": b""})
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        from_directory(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path):
    path = _variant(tmp_path, None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for tok in (from_directory(path), ByteTokenizer()):
        assert tok.chat_template is None
        with pytest.raises(NoChatTemplate, match="no chat template"):
            tok.chat_ids(CHATS["user"])


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__ }}", "unsafe"),
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe|undefined"),
    ("{% set ns = namespace(_x=1) %}", "underscore"),
    ("{{ messages.append(1) }}", "unsafe|immutable|append"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
], ids=["class", "mro", "globals", "namespace", "mutate", "raise", "syntax", "type-error"])
def test_the_sandbox_refuses_with_a_chat_template_error(tmp_path, template, match):
    tok = from_directory(_variant(tmp_path, template))
    with pytest.raises(ChatTemplateError, match=match):
        tok.render_chat(CHATS["user"])


@pytest.mark.parametrize("messages, match", [
    ([], "must not be empty"), ("hello", "list"), (["hello"], r"messages\[0\]"),
    ([{"role": "tool", "content": "x"}], "unknown role: tool")])
def test_bad_messages_are_chat_template_errors(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        from_directory(BPE).render_chat(messages)


def test_json_tokenizer_reads_its_special_ids_like_transformers():
    tok = from_directory(BPE)
    assert isinstance(tok, JsonTokenizer)
    hf = _hf(str(BPE))
    assert tok.bos_token_id == hf.bos_token_id and tok.eos_token_ids == (hf.eos_token_id,)
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.vocab_size == len(hf)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text_even_across_a_split_character(text):
    """OpenAI's logprob `bytes`: a character split over tokens is whole when their bytes join."""
    for ours in (from_directory(BPE), ByteTokenizer()):
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(t) for t in ids) == text.encode()
    assert ByteTokenizer().token_bytes(ByteTokenizer.BOS) == b"<|bos|>"


def test_token_bytes_of_a_split_character_are_its_raw_bytes():
    byte_level = from_directory(BPE)
    ids = byte_level.encode("🙂")
    assert len(ids) > 1 and b"".join(map(byte_level.token_bytes, ids)) == "🙂".encode()
    assert all(byte_level.decode([t]) == "\ufffd" for t in ids)  # the string alone cannot say it


def test_token_bytes_read_sentencepiece_byte_fallback():
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁": 256, "a": 257, "▁a": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    ours = from_files({"tokenizer.json": tok.to_str().encode()})
    ids = ours.encode(" aé")
    assert ids[0] == 258 and len(ids) == 3  # "▁a", then é's two bytes
    assert b"".join(map(ours.token_bytes, ids)) == " aé".encode()
