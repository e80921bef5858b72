"""Fixtures shared by the gateway's end-to-end, replay and server tests."""
import shutil
from pathlib import Path

import pytest

from gateway.discovery import WorkerAddress
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (Caller, FakeWorker, register_pool, running_gateway,
                                           wait_until)
from tests.gateway.live_stack import LiveStacks
from tests.gateway.server_helpers import list_workers


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
    """A cache service with pools w1 and w2, their fake workers, and a gateway over both."""
    with running_server() as cache:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        for name in workers:
            register_pool(cache.core, name)
        cache_addr = f"127.0.0.1:{cache.port}"
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers.values()]
        try:
            with running_gateway(lambda: addresses, metrics_port=0) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: len(list_workers(caller)) == 2 and gw.router.ready())
                yield gw, cache, workers, caller
                caller.close()
        finally:
            for w in workers.values():
                w.stop()
