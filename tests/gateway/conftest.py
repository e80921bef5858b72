"""Fixtures shared by the gateway's end-to-end, replay and server tests."""
import shutil
from pathlib import Path

import pytest

from tests.gateway.live_stack import LiveStacks
from tests.gateway.server_helpers import fake_fleet


@pytest.fixture(scope="session")
def live_stacks():
    """Real cache service, two real tiny-hybrid workers and `python -m gateway` (started on
    first use, shared by the tests of one pytest worker, restarted after a test broke it)."""
    stacks = LiveStacks()
    try:
        yield stacks
    finally:
        stacks.close()


BPE_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "bpe_tokenizer"


def chat_checkpoint(root: Path) -> str:
    """A checkpoint with a chat template: the tiny-hybrid preset's weights (seed 0) exported,
    with tests/data/bpe_tokenizer's tokenizer (ChatML; the presets' 320-id vocabulary)."""
    path = root / "tiny-hybrid-chat"
    if not (path / "config.json").is_file():
        from compute_service.model import build_preset, save_model  # torch: this process only

        save_model(build_preset("tiny-hybrid", seed=0), path)
        for f in BPE_TOKENIZER.iterdir():
            shutil.copy(f, path / f.name)
    return str(path)


@pytest.fixture(scope="session")
def chat_stacks():
    """Like live_stacks, over `chat_checkpoint` (so chat completions have a template), the
    gateway tokenizing with the same files."""
    stacks = LiveStacks(model=chat_checkpoint, gateway_args=("--tokenizer", "{model}"))
    try:
        yield stacks
    finally:
        stacks.close()


@pytest.fixture(scope="module")
def fleet():
    """`fake_fleet` with a metrics port: (gateway, cache server, workers, Caller)."""
    with fake_fleet(metrics_port=0) as (gw, cache, workers, _, caller):
        yield gw, cache, workers, caller
