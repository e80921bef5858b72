"""`table_impl`: an autouse fixture that runs each test of the module that imports it twice, once
with the page table's C kernel (gateway/core/index_native.py, mode on) and once with the numpy
table (mode off), both of which must give the same answers."""
from __future__ import annotations

import pytest

from gateway.core import index_native


def use(impl: str) -> None:
    """Serves the page tables with "c" (refusing to go on without it) or "numpy"."""
    index_native.configure("on" if impl == "c" else "off", index_native.TABLE.cache_dir)
    if impl == "c":
        try:
            index_native.kernel()
        except RuntimeError as exc:  # said in the test report, not silently passed
            pytest.skip(f"the C page table cannot be built here: {exc}")


@pytest.fixture(autouse=True, scope="module", params=["c", "numpy"])
def table_impl(request):
    before = index_native.TABLE.mode, index_native.TABLE.cache_dir
    use(request.param)
    yield request.param
    index_native.configure(*before)
