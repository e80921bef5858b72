"""What refusing an oversized text prompt costs the server, in peak resident memory.

An oversized text prompt used to be tokenized (memory many times its size) before the gateway or
the worker found it did not fit; now each refuses it by its size (prefixcache_client.limits). This
measures it with the server in a child process (so the client's copy of the prompt is not
counted): the child resets its peak RSS (Linux: /proc/self/clear_refs), the parent sends the
prompt, the child reports its peak above the RSS it had before.

    .venv/bin/python -m tests.bad_inputs.rejection_memory --mb 60 --out rejection_memory.json

`serve` (the child) runs the gateway over fake workers or a tiny compute worker, prints its
ports, then answers "reset" and "peak" on stdin. The test is test_rejection_memory.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

REPO = Path(__file__).resolve().parents[2]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def serve(kind: str) -> None:
    """Child: the server(s), then a command loop on stdin."""
    if kind == "gateway":
        from tests.gateway.server_helpers import fake_fleet
        context = fake_fleet(http_port=0)
    else:
        from tests.compute_service.server_harness import make_engine, running
        context = running(make_engine())
    with context as servers:
        if kind == "gateway":
            gw = servers[0]
            print(f"ports {gw.port} {gw.http_port}", flush=True)
        else:
            print(f"ports {servers[0].port} 0", flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "reset":
                before = _status()["VmRSS"]
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                print(f"ok {before}", flush=True)
            elif command == "peak":
                print(f"peak {_status()['VmHWM']}", flush=True)
            elif command == "quit":
                break


class Child:
    def __init__(self, kind: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.bad_inputs.rejection_memory",
                                      "--serve", kind], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ports", f"child did not start: {line}"
        self.grpc_port, self.http_port = int(line[1]), int(line[2])

    def ask(self, command: str) -> int:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _grpc_generate(port: int, text: str) -> str:
    from prefixcache.v1 import compute_service_pb2 as pb
    from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", 256 << 20)]) as channel:
        try:
            for _ in pb_grpc.ComputeServiceStub(channel).Generate(
                    request, metadata=[("authorization", "Bearer tok-a")], timeout=120):
                pass
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()[:120]}"
    return "OK"


def _http_completion(port: int, text: str) -> str:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": text},
                   headers={"Authorization": "Bearer tok-a"}, timeout=120)
    body = r.json()
    return f"{r.status_code}: {body['error']['message'][:120]}" if "error" in body else "OK"


def measure(kind: str, front: str, n_bytes: int) -> dict[str, object]:
    """Peak RSS growth of the `kind` server ("gateway" / "compute") while it refuses a text
    prompt of `n_bytes` sent to its `front` ("grpc" / "http")."""
    child = Child(kind)
    try:
        send = _http_completion if front == "http" else _grpc_generate
        small = send(child.http_port if front == "http" else child.grpc_port, "a" * 64)
        text = "a" * n_bytes
        before = child.ask("reset")
        start = time.perf_counter()
        answer = send(child.http_port if front == "http" else child.grpc_port, text)
        seconds = time.perf_counter() - start
        peak = child.ask("peak")
    finally:
        child.close()
    return {"server": kind, "front": front, "prompt_bytes": n_bytes, "answer": answer,
            "small_prompt_answer": small, "rss_before_bytes": before, "peak_rss_bytes": peak,
            "peak_growth_bytes": peak - before, "seconds": round(seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", choices=("gateway", "compute"), help=argparse.SUPPRESS)
    p.add_argument("--mb", type=float, default=60.0, help="prompt size in MB (10^6 bytes)")
    p.add_argument("--out", help="JSON file for the results (default: stdout only)")
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return
    n = int(args.mb * 1e6)
    results = [measure("gateway", "grpc", n), measure("gateway", "http", n),
               measure("compute", "grpc", n)]
    text = json.dumps({"prompt_bytes": n, "results": results}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
