"""The container images: hadolint-clean, multi-stage, non-root, no build tools at run time, the
service's ports and entry point, and a build context that holds what the builds copy.

There is no Docker engine here, so the images are not built; the last test builds the project's
wheel from exactly the files the build context would hold, which is the builder stage's job."""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.dockerfiles import DOCKER, DockerIgnore, exec_form, parse
from tests.deploy.manifests import REPO
from tests.deploy.test_k8s_workloads import SERVICES

IMAGES = {  # Dockerfile suffix -> (module run by ENTRYPOINT, service whose ports it exposes)
    "gateway": ("gateway", "gateway"),
    "cache": ("cache_service", "cache"),
    "compute": ("compute_service", "compute"),
    "compute-cuda": ("compute_service", "compute"),
}
PORT_ENV = {"gateway": "PREFIXCACHE_GATEWAY_PORT", "cache": "PREFIXCACHE_CACHE_PORT",
            "compute": "PREFIXCACHE_COMPUTE_PORT"}
BUILD_TOOLS = {"build-essential", "gcc", "g++", "clang", "make", "cmake", "cargo", "rustc", "git",
               "libc6-dev", "python3-dev", "python3.11-dev", "libpython3.11-dev", "pip"}
# Triton JIT-compiles its CUDA driver stub at run time: the CUDA image keeps a C compiler.
ALLOWED_IN_CUDA_FINAL = {"gcc", "libc6-dev", "libpython3.11-dev"}


def dockerfile(image: str) -> Path:
    return DOCKER / f"Dockerfile.{image}"


def final_env(df) -> dict[str, str]:
    env = {}
    for ins in df.final.all("ENV"):
        env.update(dict(re.findall(r"(\w+)=(\S+)", ins.args)))
    return env


def copied_sources(image: str) -> set[str]:
    """What the builder stage copies from the build context (files and package directories)."""
    sources = set()
    for ins in parse(dockerfile(image)).stages[0].all("COPY"):
        if "--from=" not in ins.args:
            sources.update([a for a in ins.args.split() if not a.startswith("--")][:-1])
    return sources


def copied_packages(image: str) -> set[str]:
    return {src for src in copied_sources(image) if (REPO / src / "__init__.py").exists()}


def allowlisted(image: str) -> set[str]:
    """The top-level names the image's .dockerignore lets into the context."""
    ignore = DockerIgnore((DOCKER / f"Dockerfile.{image}.dockerignore").read_text())
    return {pattern for negate, _, pattern in ignore.rules if negate}


def apt_packages(run: str) -> set[str]:
    packages = set()
    for m in re.finditer(r"apt-get install ([^&;|]*)", run):
        packages |= {w for w in m.group(1).split() if not w.startswith("-")}
    return packages


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_hadolint_is_clean(deploy_tools, image):
    done = subprocess.run([deploy_tools.hadolint, "--no-color", str(dockerfile(image))],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_multi_stage_with_the_same_base_in_both_stages(image):
    df = parse(dockerfile(image))
    assert len(df.stages) >= 2 and df.stages[0].name == "builder"
    # The venv copied from the builder points at the interpreter by path: same base, same path.
    assert df.stages[0].base == df.final.base
    if image == "compute-cuda":
        assert df.final.base.startswith("nvidia/cuda:")
    else:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", df.final.base), df.final.base
    copies = df.final.all("COPY")
    assert any("--from=builder" in c.args for c in copies)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runs_as_a_fixed_non_root_user(image):
    df = parse(dockerfile(image))
    users = df.final.all("USER")
    assert users and users[-1].args == "10001:10001"
    last_user = max(i for i, ins in enumerate(df.final.instructions) if ins.keyword == "USER")
    assert all(ins.keyword != "RUN" for ins in df.final.instructions[last_user:])
    assert any("--uid 10001" in r.args for r in df.final.all("RUN")), "needs a passwd entry"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_no_build_tools_or_pip_in_the_final_stage(image):
    df = parse(dockerfile(image))
    installed = set().union(*(apt_packages(r.args) for r in df.final.all("RUN")))
    allowed = ALLOWED_IN_CUDA_FINAL if image == "compute-cuda" else set()
    assert not (installed & BUILD_TOOLS) - allowed, installed & BUILD_TOOLS
    if installed & allowed:
        run = next(r for r in df.final.all("RUN") if apt_packages(r.args) & allowed)
        assert any("Triton" in c for c in run.comments), "say why the compiler is there"
    for ins in df.final.all("RUN"):
        assert not re.search(r"\bpip\b", ins.args), ins.args
    assert any("venv --without-pip /opt/venv" in r.args for r in df.stages[0].all("RUN"))


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_ports_and_env(image):
    module, service = IMAGES[image]
    df = parse(dockerfile(image))
    assert not df.all("HEALTHCHECK"), "Kubernetes probes check health"
    assert exec_form(df.final.all("ENTRYPOINT")[-1]) == ["python", "-m", module]
    ports = SERVICES[service]
    exposed = {int(p) for e in df.final.all("EXPOSE") for p in e.args.split()}
    assert exposed == {ports["grpc"], ports["health"], ports["metrics"],
                       *([ports["http"]] if "http" in ports else [])}
    env = final_env(df)
    if "http" in ports:  # the gateway's HTTP API is on in the image
        assert env["PREFIXCACHE_HTTP_PORT"] == str(ports["http"])
    assert env[PORT_ENV[service]] == str(ports["grpc"])
    assert env["PREFIXCACHE_HEALTH_PORT"] == str(ports["health"])
    assert env["PREFIXCACHE_METRICS_PORT"] == str(ports["metrics"])
    assert env["PATH"].startswith("/opt/venv/bin:")
    if service == "compute":
        assert env["PREFIXCACHE_CACHE_SERVICE"] == f"localhost:{SERVICES['cache']['grpc']}"
        # Read-only root filesystem: every cache directory under /tmp (an emptyDir).
        for var in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                    "HF_HOME"):
            assert env[var].startswith("/tmp"), var


def test_the_service_images_share_one_dockerignore():
    texts = {image: (DOCKER / f"Dockerfile.{image}.dockerignore").read_text()
             for image in IMAGES if image != "gateway"}
    assert len(set(texts.values())) == 1
    assert copied_sources("compute-cuda") == copied_sources("compute")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_each_dockerignore_lets_in_exactly_what_its_dockerfile_copies(image):
    assert allowlisted(image) == copied_sources(image)
    assert {"prefixcache", "prefixcache_client", "service_shell", IMAGES[image][0]} <= \
        copied_packages(image)
    if image != "gateway":  # both services use the L3 page store
        assert "pagestore" in copied_packages(image)


def test_the_gateway_image_holds_no_service_package():
    """The gateway imports neither compute_service (torch) nor cache_service
    (tests/test_import_rules.py): its image copies neither, and its context leaves them out."""
    ignore = DockerIgnore((DOCKER / "Dockerfile.gateway.dockerignore").read_text())
    assert copied_packages("gateway") == {"prefixcache", "prefixcache_client", "gateway",
                                          "service_shell"}
    for package in ("compute_service", "cache_service", "pagestore", "prefixcache_bench"):
        assert package not in copied_sources("gateway"), package
        assert ignore.excluded(f"{package}/__init__.py"), package


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copied_sources_reach_the_build_context(image):
    ignore = DockerIgnore((DOCKER / f"Dockerfile.{image}.dockerignore").read_text())
    df = parse(dockerfile(image))
    for ins in df.stages[0].all("COPY"):
        *sources, _dest = [a for a in ins.args.split() if not a.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), src
            assert not ignore.excluded(src), f"{src} is excluded from the build context"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_build_context_leaves_out_local_state(image):
    ignore = DockerIgnore((DOCKER / f"Dockerfile.{image}.dockerignore").read_text())
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "runs/x.json",
                 "deploy/k8s/base/kustomization.yaml", "gateway/__pycache__/x.cpython-311.pyc",
                 ".coverage", "bench-results/cache.json", ".hypothesis/x"):
        assert ignore.excluded(path), path
    for path in ("pyproject.toml", "README.md", "gateway/__init__.py", "prefixcache/v1/__init__.py",
                 "prefixcache_client/cache.py", "service_shell/__init__.py"):
        assert not ignore.excluded(path), path
    for path in ("cache_service/server.py", "compute_service/model/model.py",
                 "pagestore/client.py"):
        assert ignore.excluded(path) == (image == "gateway"), path


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


# compute-cuda's context is compute's (same .dockerignore and COPY lines, checked above).
@pytest.mark.parametrize("image", ["cache", "compute", "gateway"])
def test_the_build_context_builds_the_project_wheel(tmp_path, image):
    """The builder stage's `pip wheel .`, run on exactly the files the context would hold. Package
    discovery takes the packages that are there: the wheel holds exactly what the image copies."""
    ignore = DockerIgnore((DOCKER / f"Dockerfile.{image}.dockerignore").read_text())
    context = tmp_path / "context"
    for rel in ignore.context_files(REPO):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, context / rel)
    # The venv's own setuptools when it is new enough (the dev extra's grpcio-tools brings one):
    # no download. Otherwise pip's isolated build fetches the pyproject's build requirements.
    isolation = [] if _setuptools_version() < (68,) else ["--no-build-isolation"]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
                           "--quiet", "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel, = (tmp_path / "wheels").glob("prefixcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {name.split("/")[0] for name in names if "/" in name and ".dist-info/" not in name}
    assert packages == copied_packages(image)
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    if image == "gateway":  # the page table's C source, compiled in the builder stage
        assert "gateway/core/csrc/page_table.c" in names
    # The module the image runs must ship; a missing one is reported, not hidden.
    module = IMAGES[image][0]
    if not (REPO / module / "__main__.py").exists():
        pytest.skip(f"no {module} __main__ in the repository yet: the {image} image's ENTRYPOINT "
                    f"(python -m {module}) needs it")
    assert f"{module}/__main__.py" in names, module
