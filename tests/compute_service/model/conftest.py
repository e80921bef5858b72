"""Settings for the model tests."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """The models here are tiny: intra-op threads only add synchronisation, and with xdist
    workers sharing a couple of cores they oversubscribe the machine (10x slower small ops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
