"""The paged forward with per-token LoRA equals the merged-weights model, and a batch mixing
the base model and two adapters equals each sequence run alone (prefill, then decode)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from compute_service import kernels
from compute_service.lora import AdapterRegistry, LoraAdapter, merged_model, random_adapter
from compute_service.model import CausalLM, ForwardMode, build_preset
from tests.compute_service.paged_driver import PagedDriver

TOL = {"atol": 2e-4, "rtol": 1e-4}
PAGE = 16
# Adapter B: few targets per layer type, rank below A's (zero padding in the slot), rsLoRA.
B_TARGETS = ("q_proj", "v_proj", "down_proj", "in_proj")


@dataclass
class Setup:
    model: CausalLM
    registry: AdapterRegistry
    adapters: dict[str, LoraAdapter]


def _make_setup(preset: str) -> Setup:
    model = build_preset(preset, seed=3)
    adapters = {
        "a": random_adapter(preset, rank=8, alpha=16, seed=1),
        "b": random_adapter(preset, rank=4, targets=B_TARGETS, use_rslora=True, seed=2),
    }
    registry = AdapterRegistry(model, max_loaded=3, max_rank=8)
    for name, adapter in adapters.items():
        registry.add(name, adapter)
    return Setup(model, registry, adapters)


@pytest.fixture(scope="module", params=["tiny-transformer", "tiny-hybrid"])
def setup(request: pytest.FixtureRequest) -> Setup:
    return _make_setup(request.param)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_alone(
    model: CausalLM,
    prompt: list[int],
    steps: int,
    registry: AdapterRegistry | None = None,
    slot: int = -1,
    split: int = 0,
) -> list[torch.Tensor]:
    """Prefill `prompt` (in two calls when `split`), then `steps` greedy DECODE steps; returns
    the prefill's logits of every token, then each step's logits."""
    driver = PagedDriver(model, page_size=PAGE)
    seq = driver.new_sequence()

    def lora(n: int):
        return registry.lora_batch([slot], [n]) if registry is not None else None

    out = []
    for chunk in [prompt[:split], prompt[split:]] if split else [prompt]:
        out.append(driver.forward([seq], [chunk], all_logits=True, lora=lora(len(chunk))).logits)
    logits = [torch.cat(out)]
    for _ in range(steps):
        token = int(logits[-1][-1].argmax())
        step = driver.forward([seq], [[token]], mode=ForwardMode.DECODE, lora=lora(1)).logits
        logits.append(step)
    return logits


@pytest.mark.parametrize("name", ["a", "b"])
def test_adapter_equals_merged_weights(setup: Setup, name: str) -> None:
    """A 37-token prefill split mid-page (20 + 17), then 5 decode steps."""
    prompt = _prompt(37, seed=4)
    slot = setup.registry.slot_of(name)
    got = _run_alone(setup.model, prompt, 5, setup.registry, slot, split=20)
    want = _run_alone(merged_model(setup.model, setup.adapters[name]), prompt, 5, split=20)
    base = _run_alone(setup.model, prompt, 0, split=20)
    assert (got[0] - base[0]).abs().max() > 0.1, "the adapter should change the logits"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def _mixed_batch(setup: Setup) -> None:
    """base / a / b in one EXTEND call (b continuing from an earlier chunk), then 4 DECODE steps
    of all three together, each equal to the sequence run alone."""
    reg = setup.registry
    slots = [-1, reg.slot_of("a"), reg.slot_of("b")]
    prompts = [_prompt(19, 5), _prompt(33, 6), _prompt(26, 7)]
    steps = 4
    alone = [
        _run_alone(setup.model, p, steps, reg, s, split=9 if i == 2 else 0)
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True))
    ]
    driver = PagedDriver(setup.model, page_size=PAGE)
    seqs = [driver.new_sequence() for _ in prompts]
    driver.forward([seqs[2]], [prompts[2][:9]], lora=reg.lora_batch([slots[2]], [9]))
    chunks = [prompts[0], prompts[1], prompts[2][9:]]
    lens = [len(c) for c in chunks]
    logits = driver.forward(
        seqs, chunks, all_logits=True, lora=reg.lora_batch(slots, lens)
    ).logits.split(lens)
    for b in range(3):
        torch.testing.assert_close(logits[b], alone[b][0][-lens[b] :], **TOL)
    tokens = [int(logits[b][-1].argmax()) for b in range(3)]
    for step in range(1, steps + 1):
        out = driver.forward(
            seqs,
            [[t] for t in tokens],
            mode=ForwardMode.DECODE,
            lora=reg.lora_batch(slots, [1, 1, 1]),
        ).logits
        for b in range(3):
            torch.testing.assert_close(out[b], alone[b][step][0], **TOL)
        tokens = [int(row.argmax()) for row in out]


def test_mixed_batch_equals_separate_runs(setup: Setup) -> None:
    _mixed_batch(setup)


def test_triton_kernel_in_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mixed EXTEND call (base / a / b) with every projection's update from the Triton
    kernel (interpreted on CPU, hence one family and one call) equals the reference kernel's."""
    setup = _make_setup("tiny-transformer")
    reg = setup.registry
    slots = [-1, reg.slot_of("a"), reg.slot_of("b")]
    prompts = [_prompt(5, 8), _prompt(12, 9), _prompt(7, 10)]

    def run() -> torch.Tensor:
        driver = PagedDriver(setup.model, page_size=PAGE)
        seqs = [driver.new_sequence() for _ in prompts]
        lora = reg.lora_batch(slots, [len(p) for p in prompts])
        return driver.forward(seqs, prompts, all_logits=True, lora=lora).logits

    want = run()
    triton_apply = functools.partial(kernels.lora_apply, use_triton=True)
    monkeypatch.setattr(kernels, "lora_apply", triton_apply)
    torch.testing.assert_close(run(), want, **TOL)


def test_no_adapter_in_batch_is_the_base_forward(setup: Setup) -> None:
    """All sequences on the base model: no LoraBatch at all, so nothing changes."""
    assert setup.registry.lora_batch([-1, -1], [3, 1]) is None
