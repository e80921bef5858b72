"""The replay test drives the gateway's live two-worker stack."""
from tests.gateway.conftest import live_stacks  # noqa: F401  (a fixture)
