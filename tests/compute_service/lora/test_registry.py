"""AdapterRegistry: load / unload / lookups, slot limits, pins that defer slot reuse, and slots
reused by a smaller adapter keeping nothing of the previous one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compute_service.lora import (
    AdapterConfigError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRegistry,
    NoFreeSlotError,
    merged_model,
    random_adapter,
    write_random_adapter,
)
from compute_service.model import CausalLM, build_preset
from tests.compute_service.paged_driver import PagedDriver

PRESET = "tiny-transformer"


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_preset(PRESET, seed=11)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": {"rank": 8}, "b": {"rank": 4, "targets": ["q_proj", "v_proj"]}, "c": {}}
    for seed, (name, kwargs) in enumerate(specs.items()):
        write_random_adapter(root / name, PRESET, seed=seed, **kwargs)
    return {name: root / name for name in specs}


def _logits(model: CausalLM, registry: AdapterRegistry | None = None, slot: int = -1):
    prompt = list(range(40, 60))
    driver = PagedDriver(model)
    lora = registry.lora_batch([slot], [len(prompt)]) if registry is not None else None
    return driver.forward([driver.new_sequence()], [prompt], all_logits=True, lora=lora).logits


def test_load_unload_and_lookups(model: CausalLM, adapter_dirs: dict[str, Path]) -> None:
    reg = AdapterRegistry(model, max_loaded=2, max_rank=8)
    a = reg.load("a", adapter_dirs["a"])
    b = reg.load("b", adapter_dirs["b"])
    assert (a.rank, b.rank) == (8, 4)
    assert b.target_modules == ("q_proj", "v_proj")
    assert a.path == str(adapter_dirs["a"])
    assert reg.names() == ["a", "b"]
    assert {reg.slot_of("a"), reg.slot_of("b")} == {0, 1}
    assert reg.info("b") == b
    with pytest.raises(NoFreeSlotError):
        reg.load("c", adapter_dirs["c"])
    with pytest.raises(AdapterExistsError, match="^name: "):
        reg.load("a", adapter_dirs["c"])
    assert reg.unload("a") == a
    assert reg.names() == ["b"]
    with pytest.raises(AdapterNotFoundError):
        reg.slot_of("a")
    with pytest.raises(AdapterNotFoundError):
        reg.unload("a")
    assert reg.load("c", adapter_dirs["c"]).slot == a.slot
    assert reg.names() == ["b", "c"]


def test_unload_of_a_pinned_adapter_is_deferred(
    model: CausalLM, adapter_dirs: dict[str, Path]
) -> None:
    """A running sequence keeps its adapter's weights after unload until it releases the slot;
    only then can another adapter take the slot."""
    reg = AdapterRegistry(model, max_loaded=1, max_rank=8)
    reg.load("a", adapter_dirs["a"])
    slot = reg.acquire("a")
    before = _logits(model, reg, slot)
    reg.unload("a")
    assert reg.names() == []
    with pytest.raises(AdapterNotFoundError):
        reg.acquire("a")
    with pytest.raises(NoFreeSlotError):
        reg.load("c", adapter_dirs["c"])
    torch.testing.assert_close(_logits(model, reg, slot), before, rtol=0, atol=0)
    reg.release(slot)
    with pytest.raises(ValueError, match="^slot: "):
        reg.release(slot)
    with pytest.raises(ValueError, match="^seq_slots: "):
        reg.lora_batch([slot], [3])
    assert reg.load("c", adapter_dirs["c"]).slot == slot


def test_reused_slot_keeps_nothing_of_its_previous_adapter(
    model: CausalLM, adapter_dirs: dict[str, Path]
) -> None:
    """Rank 8 on all projections, then rank 4 on q/v only, in the same slot: the output is the
    rank-4 adapter's merged model (rank padding and untargeted projections were zeroed)."""
    reg = AdapterRegistry(model, max_loaded=1, max_rank=8)
    reg.load("a", adapter_dirs["a"])
    reg.unload("a")
    slot = reg.load("b", adapter_dirs["b"]).slot
    small = random_adapter(PRESET, rank=4, targets=["q_proj", "v_proj"], seed=1)
    for w in reg._weights.values():  # the CPU kernel's transposed copy follows B exactly
        assert w.B_t is not None and torch.equal(w.B_t, w.B.transpose(1, 2))
    want = _logits(merged_model(model, small))
    torch.testing.assert_close(_logits(model, reg, slot), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["", "a/b", "x" * 257, "é", "a b", "../up"])
def test_bad_names_are_refused(model: CausalLM, adapter_dirs: dict[str, Path], name: str) -> None:
    reg = AdapterRegistry(model, max_loaded=1, max_rank=8)
    with pytest.raises(AdapterConfigError, match="^name: ") as err:
        reg.load(name, adapter_dirs["b"])
    assert err.value.field == "name"
    assert reg.names() == []


def test_good_names_are_accepted(model: CausalLM) -> None:
    reg = AdapterRegistry(model, max_loaded=2, max_rank=8)
    for name in ["A-z_0.9", "n" * 256]:
        reg.add(name, random_adapter(PRESET, rank=2, targets=["o_proj"]))
    assert reg.names() == sorted(["A-z_0.9", "n" * 256])


def test_rank_and_target_limits(model: CausalLM) -> None:
    reg = AdapterRegistry(model, max_loaded=2, max_rank=8, targets=["q_proj", "v_proj"])
    with pytest.raises(AdapterConfigError, match="^r: ") as err:
        reg.add("big", random_adapter(PRESET, rank=16, targets=["q_proj"]))
    assert err.value.field == "r"
    with pytest.raises(AdapterConfigError, match="^target_modules: .*gate_proj"):
        reg.add("mlp", random_adapter(PRESET, rank=4, targets=["q_proj", "gate_proj"]))
    assert reg.names() == []
    with pytest.raises(ValueError, match="^targets: "):
        AdapterRegistry(model, targets=["embed_tokens"])


def test_lora_batch_layout(model: CausalLM) -> None:
    """token_slot follows the packed sequences; only targeted projections get weights."""
    reg = AdapterRegistry(model, max_loaded=3, max_rank=8)
    reg.add("q", random_adapter(PRESET, rank=4, targets=["q_proj"]))
    reg.add("mlp", random_adapter(PRESET, rank=4, targets=["down_proj"]))
    lora = reg.lora_batch([1, -1, 0], [2, 3, 1])
    assert lora is not None and len(lora.layers) == model.config.num_layers
    for layer in lora.layers:
        assert layer is not None and layer.token_slot.tolist() == [1, 1, -1, -1, -1, 0]
        assert sorted(layer.weights) == ["down_proj", "q_proj"]
    only_q = reg.lora_batch([0], [4])
    assert all(sorted(layer.weights) == ["q_proj"] for layer in only_q.layers)
    with pytest.raises(ValueError, match="^seq_slots/num_tokens: "):
        reg.lora_batch([0, 1], [4])
    with pytest.raises(ValueError, match="^seq_slots: "):
        reg.lora_batch([2], [4])
