"""Each HTTP route family is an `APIRouter` that serves alone: a bare FastAPI app with one
router and its dependencies overridden (no gateway, no workers, no core), as a unit test of
that route would build it."""
from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.core.tenants import Tenant, TenantDirectory
from gateway.http import deps, errors
from gateway.http.models import Models
from gateway.http.routes import health, models


class FakeCatalog:
    async def models(self, force: bool = False) -> Models:
        return Models("base-model", ("adapter-a",), 128)


def serve(router, **overrides) -> TestClient:
    app = FastAPI()
    errors.install(app)  # OpenAI's error bodies, as create_app installs them
    app.include_router(router)
    for dependency, value in overrides.items():
        app.dependency_overrides[getattr(deps, dependency)] = (lambda v=value: v)
    return TestClient(app)


def test_health_alone():
    assert serve(health.router, readiness=lambda: True).get("/health").json() == {
        "status": "ready"}
    client = serve(health.router, readiness=lambda: False)
    assert client.get("/health").status_code == 503
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 404  # not served


def test_models_alone():
    client = serve(models.router, tenant=Tenant("t", "salt"), catalog=FakeCatalog(),
                   created=7)
    body = client.get("/v1/models").json()
    assert [(m["id"], m["created"], m["max_model_len"]) for m in body["data"]] == [
        ("base-model", 7, 128), ("adapter-a", 7, 128)]
    assert body["data"][1]["parent"] == "base-model"


def test_models_alone_with_the_real_tenant_dependency():
    # Only the proxy (for its tenants) and the catalog are faked: deps.tenant itself runs.
    proxy = SimpleNamespace(tenants=TenantDirectory({}, allow_anonymous=False))
    client = serve(models.router, proxy=proxy, catalog=FakeCatalog(), created=0)
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
