"""Fixtures of the deployment tests: the tools (installed on first use) and every rendering."""
from __future__ import annotations

import pytest

from tests.deploy import tools
from tests.deploy.manifests import VARIANTS, Doc, render


@pytest.fixture(scope="session")
def deploy_tools() -> tools.Tools:
    try:
        return tools.ensure()
    except RuntimeError as exc:  # a missing tool is a failure, never a silent skip
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def renders(deploy_tools: tools.Tools) -> dict[str, list[Doc]]:
    return {name: render(deploy_tools.kustomize, name) for name in VARIANTS}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture
def docs(renders: dict[str, list[Doc]], variant: str) -> list[Doc]:
    return renders[variant]
