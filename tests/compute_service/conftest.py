"""Fixtures of the compute service's server tests (test_server_*.py): one torch thread, a
shared tiny-transformer worker, and LoRA adapters on disk."""
from __future__ import annotations

import json

import pytest

from compute_service.lora import write_random_adapter
from tests.compute_service.server_harness import make_engine, running


@pytest.fixture(scope="module")
def shared():
    """One tiny-transformer worker for the tests that use prompts of their own."""
    with running(make_engine(), metrics_port=0) as pair:
        yield pair


# Adapters for tiny-transformer: name -> write_random_adapter arguments.
ADAPTERS = {
    "a": dict(rank=8, seed=1, strength=0.5),
    "b": dict(rank=4, seed=2, strength=0.5, targets=("q_proj", "v_proj")),
    "c": dict(rank=8, seed=3, strength=0.5),
    "r16": dict(rank=16, seed=4),  # above the workers' max_lora_rank of 8
}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    """The ADAPTERS in PEFT format, plus broken ones: name -> directory."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for name, kwargs in ADAPTERS.items():
        write_random_adapter(root / name, "tiny-transformer", **kwargs)
        dirs[name] = str(root / name)
    corrupt = root / "corrupt"
    write_random_adapter(corrupt, "tiny-transformer", rank=4, seed=5)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    dirs["corrupt"] = str(corrupt)
    dora = root / "dora"
    write_random_adapter(dora, "tiny-transformer", rank=4, seed=6)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    dirs["dora"] = str(dora)
    dirs["missing"] = str(root / "no-such-dir")
    return dirs
