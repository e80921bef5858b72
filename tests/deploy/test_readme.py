"""deploy/README.md stays true: it names every setting the manifests and images use, and the
own-overlay recipe it gives (replace the example secrets, add components, re-point images) renders
to what it promises."""
from __future__ import annotations

import base64
import json
import os
import re

from tests.deploy.dockerfiles import DOCKER
from tests.deploy.manifests import K8S, REPO, by_kind, containers, render_dir

README = REPO / "deploy" / "README.md"


def test_readme_names_every_setting_and_build(renders):
    text = README.read_text()
    used = set()
    for docs in renders.values():
        for c in containers(docs):
            used |= {e["name"] for e in c.spec.get("env", []) if e["name"].startswith("PREFIXCACHE_")}
        for cm in by_kind(docs, "ConfigMap"):
            used |= {k for k in cm.get("data", {}) if k.startswith("PREFIXCACHE_")}
    for dockerfile in DOCKER.glob("Dockerfile.*"):
        if dockerfile.suffix != ".dockerignore":
            used |= set(re.findall(r"\b(PREFIXCACHE_[A-Z0-9_]+)=", dockerfile.read_text()))
            assert f"docker build -f deploy/docker/{dockerfile.name} " in text, dockerfile.name
    assert used, "found no settings"
    missing = sorted(v for v in used if f"`{v}`" not in text)
    assert not missing, f"not documented in deploy/README.md: {missing}"
    for part in ("overlays/dev-cpu", "overlays/gpu", "components/monitoring", "components/mtls",
                 "scripts/run.sh", "kubectl apply -k"):
        assert part in text, part


def test_the_own_overlay_recipe_renders(deploy_tools, tmp_path):
    text = README.read_text()
    recipe = next(block for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
                  if "secretGenerator" in block)
    mine = tmp_path / "my-cluster"
    (mine / "secrets").mkdir(parents=True)
    # The recipe's paths are relative to a directory beside the repository; make them reach it.
    recipe = recipe.replace("../../deploy/k8s/", os.path.relpath(K8S, mine) + "/")
    (mine / "kustomization.yaml").write_text(recipe)
    (mine / "secrets" / "redis-password").write_text("0123456789abcdef")
    (mine / "secrets" / "l3-mac-key").write_text("0123456789abcdef0123456789abcdef")
    tenants = {"tokens": {"t0k3n": {"tenant": "acme", "salt": "s4lt"}}}
    (mine / "secrets" / "tenants.json").write_text(json.dumps(tenants))
    identities = {"identities": [{"name": "gw", "role": "gateway", "token_sha256": "ab" * 32}]}
    (mine / "secrets" / "service-identities.json").write_text(json.dumps(identities))
    (mine / "secrets" / "gateway-service-token").write_text("gateway-token-0123456789")
    (mine / "secrets" / "worker-service-token").write_text("worker-token-0123456789")

    docs = render_dir(deploy_tools.kustomize, mine)
    secrets = {d["metadata"]["name"].rsplit("-", 1)[0]: d for d in by_kind(docs, "Secret")}
    assert base64.b64decode(secrets["redis-auth"]["data"]["password"]) == b"0123456789abcdef"
    assert json.loads(base64.b64decode(secrets["gateway-tenants"]["data"]["tenants.json"])) == tenants
    assert json.loads(base64.b64decode(
        secrets["service-identities"]["data"]["service-identities.json"])) == identities
    assert base64.b64decode(secrets["worker-service-token"]["data"]["token"]) == \
        b"worker-token-0123456789"
    assert by_kind(docs, "ServiceMonitor") and by_kind(docs, "Certificate")
    images = {c.spec["image"] for c in containers(docs)}
    assert images == {"registry.example.com/prefixcache/gateway:0.1.0",
                      "registry.example.com/prefixcache/cache:0.1.0",
                      "registry.example.com/prefixcache/compute-cuda:0.1.0",
                      "redis:7.4-alpine"}, images
    assert "EXAMPLE" not in json.dumps(docs).upper().replace("REGISTRY.EXAMPLE.COM", "")
