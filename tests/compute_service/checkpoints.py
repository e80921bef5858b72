"""Hugging Face checkpoints made from the presets for the tests: any vocabulary, the token ids of
config.json and generation_config.json, and optionally a tokenizer's files beside the weights;
and a worker served over such a directory the way `python -m compute_service --model DIR` loads
it (compute_service.__main__.load)."""
from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from cache_service.core import CacheCore
from compute_service.__main__ import load, parse_args
from compute_service.engine import Engine, EngineConfig
from compute_service.model import CausalLM, init_random_, preset_config, save_model
from compute_service.server import ComputeServer
from prefixcache_client.compute import ComputeClient
from tests.compute_service.server_harness import running

BPE_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "bpe_tokenizer"
PAGE = 4


def preset_model(preset: str, seed: int = 0, vocab: int | None = None) -> CausalLM:
    """The preset's architecture with random weights from `seed`, and `vocab` ids if given
    (no special ids: the checkpoint's configs name them)."""
    cfg = preset_config(preset).replace(bos_token_id=None, eos_token_ids=(), pad_token_id=None)
    if vocab is not None:
        cfg = cfg.replace(vocab_size=vocab)
    return init_random_(CausalLM.empty(cfg.validate(), torch.float32, "cpu"), seed).eval()


def write_checkpoint(path: Path, model: CausalLM, *, bos: int | None = None,
                     eos: int | list[int] | None = None, generation: dict | None = None,
                     tokenizer: Path | None = None) -> Path:
    """`model` as an HF checkpoint in `path` with config.json's `bos_token_id` and
    `eos_token_id`, generation_config.json = `generation` when given, and the tokenizer files
    of directory `tokenizer` when given."""
    save_model(model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(bos_token_id=bos, eos_token_id=eos)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            shutil.copy(file, path / file.name)
    return path


@contextlib.contextmanager
def serving(path: Path, pool_id: str = "ckpt-worker",
            cache=None) -> Iterator[tuple[ComputeServer, ComputeClient]]:
    """An in-process worker over checkpoint `path`, loaded as the command line loads it."""
    args = parse_args(["--model", str(path), "--device", "cpu"])
    model, tokenizer, model_id, defaults = load(args)
    engine = Engine(model, tokenizer, cache or CacheCore(), EngineConfig(
        page_size=PAGE, device_pages=64, token_budget=64, max_running=4, max_context=256,
        model_id=model_id, pool_id=pool_id))
    with running(engine, defaults) as (server, client):
        yield server, client
