"""L2: with a small device pool and a host tier, evicted pages are demoted to the host and a
later request loads them back (design.md lesson 12) with output identical to the cold reference."""
from __future__ import annotations

import pytest

from compute_service.tiers import PageLayout
from tests.compute_service.hf_families import HF_FAMILIES
from tests.compute_service.tiers.helpers import PROMPT, generate, prompt_of, reference


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-hybrid", *HF_FAMILIES])
def test_demoted_pages_are_loaded_back_from_the_host(workers, name):
    # 10 device pages hold one 37-token request; the second request demotes the first's pages.
    eng = workers(name, device_pages=10, host_pages=16)
    other = prompt_of(7, 33)
    assert generate(eng, PROMPT)[0] == reference(name, tuple(PROMPT))
    assert generate(eng, other)[0] == reference(name, tuple(other))
    toks, s = generate(eng, PROMPT)
    assert toks == reference(name, tuple(PROMPT))
    assert s.cached_tokens_host > 0
    assert s.cached_tokens_device + s.cached_tokens_host == 32
    assert s.computed_prompt_tokens == 1
    # The copies moved real bytes: the host pool is no longer all zeros.
    assert any(k.abs().sum() > 0 for k, _ in eng.host_kv)
    assert eng.host_kv[0][0].shape[0] == 16 and eng.host_kv[0][0].device.type == "cpu"


def test_host_pool_matches_the_device_pool_layout(workers):
    eng = workers("tiny-transformer", device_pages=8, host_pages=3)
    lay = PageLayout.of_model(eng.model.config, 4, eng.model.dtype)
    for (dk, dv), (hk, hv) in zip(eng.kv, eng.host_kv, strict=True):
        assert hk.shape[1:] == dk.shape[1:] == lay.kv_shape[2:] and hk.dtype == dk.dtype
