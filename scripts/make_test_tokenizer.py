"""Writes tests/data/bpe_tokenizer/: a small real byte-level BPE `tokenizer.json` and a
`tokenizer_config.json` with a ChatML chat template, for the tokenizer tests.

The vocabulary is 320 ids (4 special tokens, the 256 byte symbols, 60 merges), the tiny
presets' vocabulary, so that a preset's weights exported with these files are a checkpoint whose
every token id exists. Trained on text generated here from a fixed seed, so running the script
again reproduces the committed files byte for byte (`--check` says whether they are current).

    .venv/bin/python scripts/make_test_tokenizer.py [--check]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "bpe_tokenizer"
SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320
# ChatML with a BOS at the start and an optional system prompt; it raises on an unknown role
# and on a conversation that does not alternate, as many published templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = ("the cache page prefix token worker gateway model prompt system user assistant "
          "hello world answer question river mountain small large quick brown fox jumps over "
          "lazy dog serving stack never computes same twice").split()


def corpus(seed: int = 0, lines: int = 300) -> list[str]:
    """A few KB of text: sentences of common words, some numbers and punctuation, and a little
    non-ASCII, so that merges form over words and multi-byte characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        if rng.random() < 0.2:
            words.append(rng.choice(["héllo", "naïve", "über", "日本", "🙂"]))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def build() -> dict[str, str]:
    """File name -> content."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    # A text starts with BOS, as Llama 3's post-processor has it (transformers' tokenizer(text)
    # and the workers' text prompts); chat templates write their own BOS.
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|eos|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the files are stale")
    args = parser.parse_args(argv)
    files = build()
    if args.check:
        stale = [n for n, c in files.items()
                 if not (OUT / n).is_file() or (OUT / n).read_text() != c]
        print(f"stale: {', '.join(stale)}" if stale else "up to date")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (OUT / name).write_text(content)
    print(f"wrote {', '.join(files)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
