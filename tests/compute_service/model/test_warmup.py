"""A CPU worker's warm-up (compute_service/model/warmup.py): every projection packed before the
first request, the packed copy replacing the weight (storage released, shape kept), the results
unchanged, a released weight refused by the F.linear fallback rather than read as zeros, a tied
embedding kept; and the default KV pool sized from memory rather than a fixed page count."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from compute_service import kernels
from compute_service.kernels import linear_cpu
from compute_service.model import build_preset
from compute_service.model.lora_batch import project, project_group
from compute_service.model.warmup import warm_up
from compute_service.sizing import SizingRequest, kv_bytes_per_page, size_pools

pytestmark = pytest.mark.skipif(linear_cpu.backend() == "torch",
                                reason="no packed GEMM in this torch build")


def storage_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        st = p.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-hybrid"])
def test_warm_up_packs_in_place_and_keeps_the_results(preset):
    model = build_preset(preset, seed=4)
    original = copy.deepcopy(model)
    before = storage_bytes(model)
    assert warm_up(model) > 1
    assert storage_bytes(model) < before / 3  # the projections no longer hold their storage
    x = torch.randn(3, model.config.hidden_size)
    alone = ("o_proj", "down_proj", "in_proj", "out_proj", "lm_head")  # not stacked
    for (name, lin), (_, ref) in zip(model.named_modules(), original.named_modules()):
        if isinstance(lin, torch.nn.Linear):
            assert linear_cpu.is_released(lin.weight), name
            assert lin.weight.shape == ref.weight.shape
            short = name.rsplit(".", 1)[-1]
            xi = torch.randn(3, lin.in_features)
            if short in alone:
                torch.testing.assert_close(project(lin, xi, None, short),
                                           F.linear(xi, ref.weight, ref.bias), rtol=1e-5, atol=1e-5)
            else:  # packed in its group only: alone it would be re-packed from nothing
                with pytest.raises(RuntimeError, match="another group"):
                    project(lin, xi, None, short)
    attn = model.layers[0].attn
    if hasattr(attn, "q_proj"):
        ref = original.layers[0].attn
        got = project_group((attn.q_proj, attn.k_proj, attn.v_proj), x, None, ("q", "k", "v"))
        want = [F.linear(x, r.weight, r.bias) for r in (ref.q_proj, ref.k_proj, ref.v_proj)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.logits(x), original.logits(x), rtol=1e-5, atol=1e-5)
    # A tied embedding is released into its native packed copy, whose rows the lookup reads;
    # otherwise the lookup reads the embedding itself, never released.
    tied_native = model.lm_head is None and linear_cpu.backend() == "native"
    assert linear_cpu.is_released(model.embed.weight) == tied_native
    ids = torch.tensor([0, 1, 31, 32, 33, model.config.vocab_size - 1])
    assert torch.equal(model.embed_tokens(ids), original.embed.weight[ids])


@pytest.mark.skipif(linear_cpu.backend() != "native", reason="the native packed layout")
def test_a_tied_embedding_is_read_from_its_packed_copy():
    model = build_preset("tiny-transformer", seed=4)
    model.lm_head = None  # tie it (the logits then use the embedding)
    original = copy.deepcopy(model)
    warm_up(model)
    assert linear_cpu.is_released(model.embed.weight)
    ids = torch.arange(model.config.vocab_size)
    assert torch.equal(model.embed_tokens(ids), original.embed.weight)
    x = torch.randn(2, model.config.hidden_size)
    torch.testing.assert_close(model.logits(x), original.logits(x), rtol=1e-5, atol=1e-5)


def test_a_released_weight_is_refused_where_it_would_be_read():
    model = build_preset("tiny-transformer", seed=4)
    warm_up(model)
    w = model.layers[0].mlp.down_proj.weight
    with pytest.raises(RuntimeError, match="released after packing"):
        kernels.linear(torch.randn(1, 2, w.shape[1]), w)  # 3-D: the F.linear path


def test_the_default_cpu_pool_is_sized_from_memory_not_a_fixed_page_count():
    model = build_preset("tiny-transformer", seed=4)
    page = kv_bytes_per_page(model.config, 16, torch.float32)
    req = SizingRequest(page_size=16, max_context=256, max_running=4)
    assert size_pools(req, model.config, torch.float32).device_pages == 1024
    small = SizingRequest(page_size=16, max_context=256, max_running=4,
                          default_kv_bytes=100 * page)
    assert size_pools(small, model.config, torch.float32).device_pages == 100
    tiny = SizingRequest(page_size=16, max_context=256, max_running=4, default_kv_bytes=page)
    assert size_pools(tiny, model.config, torch.float32).device_pages == 256 // 16  # one request
    given = SizingRequest(page_size=16, max_context=256, max_running=4, device_pages=300,
                          default_kv_bytes=page)
    assert size_pools(given, model.config, torch.float32).device_pages == 300
