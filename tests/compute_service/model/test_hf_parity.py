"""Logits of our paged forward vs transformers' own implementation, on tiny HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compute_service.model import ForwardMode, load_model, save_model
from tests.compute_service.model.hf_reference import HF_CASES, VOCAB, build_hf_model, hf_logits
from tests.compute_service.paged_driver import PagedDriver

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", list(HF_CASES))
def test_prefill_then_decode_matches_hf(case: str, tmp_path: Path) -> None:
    """A 15-token prefill (all positions) then 9 single-token DECODE steps (teacher-forced),
    page size 4 so pages end mid-prompt; windows (6-7) are shorter than the sequence."""
    hf = build_hf_model(case, tmp_path)
    ids = _ids(24, seed=1)
    ref = hf_logits(hf, ids)
    driver = PagedDriver(load_model(tmp_path), num_pages=32, page_size=4)
    seq = driver.new_sequence()
    prefill = driver.forward([seq], [ids[:15]], all_logits=True).logits
    torch.testing.assert_close(prefill, ref[:15], **TOL)
    for pos in range(15, 24):
        step = driver.forward([seq], [[ids[pos]]], mode=ForwardMode.DECODE).logits
        torch.testing.assert_close(step[0], ref[pos], **TOL)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_batched_chunked_extend_matches_hf(case: str, tmp_path: Path) -> None:
    """Two sequences prefilled together in chunks that split pages unevenly
    (a: 5+9+10, b: 11+2+11 with page size 4), compared position by position."""
    hf = build_hf_model(case, tmp_path, seed=2)
    a, b = _ids(24, seed=3), _ids(24, seed=4)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    driver = PagedDriver(load_model(tmp_path), num_pages=32, page_size=4)
    sa, sb = driver.new_sequence(), driver.new_sequence()
    got_a, got_b = [], []
    for (a0, a1), (b0, b1) in zip(
        [(0, 5), (5, 14), (14, 24)], [(0, 11), (11, 13), (13, 24)], strict=True
    ):
        logits = driver.forward([sa, sb], [a[a0:a1], b[b0:b1]], all_logits=True).logits
        got_a.append(logits[: a1 - a0])
        got_b.append(logits[a1 - a0 :])
    torch.testing.assert_close(torch.cat(got_a), ref_a, **TOL)
    torch.testing.assert_close(torch.cat(got_b), ref_b, **TOL)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = build_hf_model("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = _ids(10, seed=5)
    driver = PagedDriver(load_model(tmp_path), page_size=4)
    got = driver.forward([driver.new_sequence()], [ids], all_logits=True).logits
    torch.testing.assert_close(got, hf_logits(hf, ids), **TOL)


@pytest.mark.parametrize("case", [c for c in HF_CASES if c.startswith(("nemotron", "granite", "falcon"))])
def test_saved_hybrid_family_loads_back_in_transformers(case: str, tmp_path: Path) -> None:
    """save_model writes config.json and names that transformers reads into the same model."""
    transformers = pytest.importorskip("transformers")
    hf = build_hf_model(case, tmp_path / "hf")
    save_model(load_model(tmp_path / "hf"), tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    ids = _ids(12, seed=6)
    torch.testing.assert_close(hf_logits(again, ids), hf_logits(hf, ids), **TOL)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_every_vector_parameter_is_away_from_its_initial_value(case: str, tmp_path: Path) -> None:
    """Each norm weight, bias, A_log, D and dt_bias differs from what transformers initialises
    it to, so a loader that dropped one (leaving the init value) fails the parity tests."""
    transformers = pytest.importorskip("transformers")
    perturbed = dict(build_hf_model(case, tmp_path).named_parameters())
    cls_name, kwargs = HF_CASES[case]
    torch.manual_seed(0)
    fresh = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls_name)(vocab_size=VOCAB, **kwargs), attn_implementation="eager"
    )
    vectors = [(n, p) for n, p in fresh.named_parameters() if p.ndim == 1]
    assert vectors
    for name, p in vectors:
        assert not torch.equal(p, perturbed[name]), name


def _rewrite(path: Path, rename) -> None:
    """Rewrites path/model.safetensors with each tensor name passed through `rename` (None drops)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({rename(k): v for k, v in tensors.items() if rename(k)}, file, metadata={"format": "pt"})


def test_granite_moe_reads_transformers_in_memory_expert_names(tmp_path: Path) -> None:
    """transformers v5 holds Granite's experts as block_sparse_moe.{router.weight,
    experts.gate_up_proj, experts.down_proj} (its save_pretrained writes the hub's
    router.layer / input_linear / output_linear): both spellings load into the same model."""
    hf = build_hf_model("granitemoehybrid-moe", tmp_path)
    v5 = {"router.layer.weight": "router.weight", "input_linear.weight": "experts.gate_up_proj",
          "output_linear.weight": "experts.down_proj"}

    def rename(name: str) -> str:
        for hub, mem in v5.items():
            name = name.replace(f"block_sparse_moe.{hub}", f"block_sparse_moe.{mem}")
        return name

    _rewrite(tmp_path, rename)
    ids = _ids(12, seed=7)
    driver = PagedDriver(load_model(tmp_path), page_size=4)
    got = driver.forward([driver.new_sequence()], [ids], all_logits=True).logits
    torch.testing.assert_close(got, hf_logits(hf, ids), **TOL)


def test_granite_moe_without_its_router_is_refused_naming_it(tmp_path: Path) -> None:
    build_hf_model("granitemoehybrid-moe", tmp_path)
    _rewrite(tmp_path, lambda n: None if n == "model.layers.1.block_sparse_moe.router.layer.weight" else n)
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.gate\.weight"):
        load_model(tmp_path)
