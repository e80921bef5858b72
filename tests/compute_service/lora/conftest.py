"""Settings and shared pieces of the LoRA tests."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """Tiny models: intra-op threads only add synchronisation and oversubscribe shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
