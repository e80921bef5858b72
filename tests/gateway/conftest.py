"""Fixtures shared by the gateway's end-to-end and replay tests."""
import pytest

from tests.gateway.live_stack import LiveStacks


@pytest.fixture(scope="session")
def live_stacks():
    """Real cache service, two real tiny-hybrid workers and `python -m gateway` (started on
    first use, shared by the tests of one pytest worker, restarted after a test broke it)."""
    stacks = LiveStacks()
    try:
        yield stacks
    finally:
        stacks.close()
