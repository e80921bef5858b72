"""Fixtures of the tier tests (L2 host pool, L3 Redis)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.compute_service.tiers.helpers import make_worker


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """Tiny models: intra-op threads only add synchronisation and oversubscribe shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def workers() -> Iterator:
    """Like helpers.make_worker; every worker made is closed (its L3 writer stopped) at
    teardown."""
    made = []

    def make(*args, **kwargs):
        made.append(make_worker(*args, **kwargs))
        return made[-1]

    yield make
    for eng in made:
        eng.close()
