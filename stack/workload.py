"""The demo workload, sent through the gateway the way clients would: multi-turn conversations,
a burst of requests sharing a prefix, two tenants sending the same prompt, a request under a
LoRA adapter (gRPC, each previewed first: where the gateway would send it, and why), and a chat
with a next turn through the OpenAI-compatible HTTP API (streamed; `usage.prefixcache` says
where the prompt came from and why the worker was chosen). Each request is one row of the
summary."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc

from prefixcache.v1 import compute_service_pb2 as cpb, compute_service_pb2_grpc as cgrpc
from prefixcache.v1 import gateway_pb2 as gpb, gateway_pb2_grpc as ggrpc

SYSTEM = ("You are the support assistant of a small bookshop. Answer briefly and politely, quote "
          "prices in euros, and never promise a delivery date you cannot keep. The catalogue has "
          "novels, poetry, history, cookery and children's books; orders over 40 euros ship free "
          "within the country, and returns are accepted within 30 days with the receipt. ")
MODEL = "demo-chat"  # the demo checkpoint's directory name, which is its model id
QUESTIONS = ["Do you have the new poetry anthology?", "How long does shipping take?",
             "Can I return a gift without a receipt?", "Is there a discount for students?",
             "Which cookery books do you recommend?", "Do you ship abroad?"]


@dataclass(slots=True)
class Row:
    name: str
    tenant: str
    prompt_tokens: int
    device: int
    host: int
    remote: int
    in_flight: int
    computed: int
    ttft_ms: float
    worker: str
    why: str
    answer: str = ""


class Client:
    """Authenticated calls to the gateway (one bearer token per tenant), over gRPC at `address`
    and over HTTP at `http` (a base URL)."""

    def __init__(self, address: str, http: str, tokens: dict[str, str], max_tokens: int = 24,
                 stop_at_eos: bool = False):
        # A random-weight model's answers run to max_tokens (ignore_eos), so that every run
        # has the same lengths; a trained model's stop at its end-of-turn token.
        self.max_tokens, self.ignore_eos = max_tokens, not stop_at_eos
        self.http = http
        self.channel = grpc.insecure_channel(address)
        self.compute = cgrpc.ComputeServiceStub(self.channel)
        self.gateway = ggrpc.GatewayServiceStub(self.channel)
        self.tokens = tokens
        self.rows: list[Row] = []
        self._lock = threading.Lock()

    def _meta(self, tenant: str):
        return (("authorization", f"Bearer {self.tokens[tenant]}"),)

    def ask(self, name: str, tenant: str, text: str, adapter: str = "",
            together: threading.Barrier | None = None) -> str:
        """Previews the route, then runs the request (after `together` releases it, if given)."""
        req = cpb.GenerateRequest(request_id=name, text=text, adapter=adapter,
                                  sampling=cpb.SamplingParams(max_tokens=self.max_tokens,
                                                              temperature=0,  # reproducible
                                                              ignore_eos=self.ignore_eos))
        preview = self.gateway.RoutePreview(gpb.RoutePreviewRequest(request=req),
                                            metadata=self._meta(tenant), timeout=10)
        if together is not None:
            together.wait()
        answer, stats = [], None
        for msg in self.compute.Generate(req, metadata=self._meta(tenant), timeout=120):
            answer.append(msg.text)
            if msg.HasField("stats"):
                stats = msg.stats
        with self._lock:
            self.rows.append(Row(
                name, tenant, stats.prompt_tokens, stats.cached_tokens_device,
                stats.cached_tokens_host, stats.cached_tokens_remote, stats.shared_tokens_in_flight,
                stats.computed_prompt_tokens, stats.ttft_s * 1000, stats.worker, preview.reason,
                "".join(answer)))
        return "".join(answer)

    def chat(self, name: str, tenant: str, messages: list[dict]) -> str:
        """One streamed chat completion through the HTTP API; TTFT is the first content chunk's
        arrival as this client sees it."""
        body = {"model": MODEL, "messages": messages, "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                "ignore_eos": self.ignore_eos}
        req = urllib.request.Request(
            f"{self.http}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {self.tokens[tenant]}",
                     "Content-Type": "application/json"})
        started, first, answer, usage = time.perf_counter(), None, [], None
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                data = line.decode().strip().removeprefix("data:").strip()
                if not line.startswith(b"data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    text = choice["delta"].get("content")
                    if text:
                        first = first or time.perf_counter()
                        answer.append(text)
                usage = chunk.get("usage") or usage
        ext = usage["prefixcache"]
        with self._lock:
            self.rows.append(Row(
                name, tenant, usage["prompt_tokens"], ext["cached_tokens_device"],
                ext["cached_tokens_host"], ext["cached_tokens_remote"],
                ext["shared_tokens_in_flight"], ext["computed_prompt_tokens"],
                ((first or time.perf_counter()) - started) * 1000, ext["worker"],
                f"HTTP: {ext['route_reason']}", "".join(answer)))
        return "".join(answer)

    def close(self) -> None:
        self.channel.close()


def run(client: Client, adapter: str | None, drain_worker=None, seed: int = 7) -> None:
    """`drain_worker()`, when given, stops the worker holding the conversations (a rolling
    update) before one more turn of each: another worker then loads them from L3."""
    rng = random.Random(seed)
    # 1. Conversations: every turn resends the history; the worker holding it should get it.
    histories = []
    for conv in range(3):
        history = SYSTEM + f"Customer {conv}: {rng.choice(QUESTIONS)}\nAssistant:"
        for turn in range(3):
            answer = client.ask(f"chat{conv}-turn{turn}", "alice", history)
            history += answer + f"\nCustomer {conv}: {rng.choice(QUESTIONS)}\nAssistant:"
        histories.append(history)
    # 2. A burst of 6 samples of one new long prompt, released together (RL rollouts): one
    #    computes the prompt, the others wait for its publishes instead of computing it again.
    prompt = SYSTEM * 2 + "Write a short poem about second-hand books.\nAssistant:"
    together = threading.Barrier(6)
    threads = [threading.Thread(target=client.ask, args=(f"burst-{i}", "alice", prompt),
                                kwargs={"together": together}) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 3. Two tenants, the same prompt: the salt keeps them apart (bob's first call must not hit).
    shared = SYSTEM + "What are your opening hours on Sunday?\nAssistant:"
    for name, tenant in (("alice-sunday", "alice"), ("bob-sunday", "bob"), ("bob-sunday-2", "bob")):
        client.ask(name, tenant, shared)
    # 4. A LoRA adapter: its KV differs from the base model's, so it shares nothing with it.
    if adapter:
        client.ask("base-hours", "alice", shared)
        client.ask("lora-hours", "alice", shared, adapter=adapter)
        client.ask("lora-hours-2", "alice", shared, adapter=adapter)
    # 5. A chat through the OpenAI-compatible HTTP API, rendered with the model's chat template,
    #    then its next turn: the rendered history is a prefix of the next turn's, so it is reused.
    messages = [{"role": "system", "content": SYSTEM.strip()},
                {"role": "user", "content": "Do you have the new poetry anthology?"}]
    answer = client.chat("http-chat", "alice", messages)
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And how long does shipping take?"}]
    client.chat("http-chat-2", "alice", messages)
    # 6. A rolling update: the worker holding the conversations goes away; their next turns land
    #    on another worker, which loads them from L3 (Redis) instead of recomputing them.
    if drain_worker is not None:
        drain_worker()
        for conv, history in enumerate(histories):
            client.ask(f"chat{conv}-turn3", "alice", history)


def summary(rows: list[Row]) -> str:
    head = (f"{'request':<14}{'tenant':<7}{'prompt':>7}{'device':>7}{'host':>5}{'L3':>5}"
            f"{'shared':>7}{'computed':>9}{'TTFT ms':>9}  {'worker':<10}why")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<14}{r.tenant:<7}{r.prompt_tokens:>7}{r.device:>7}{r.host:>5}"
                     f"{r.remote:>5}{r.in_flight:>7}{r.computed:>9}{r.ttft_ms:>9.0f}  {r.worker:<10}"
                     f"{r.why[:60]}")
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.device + r.host + r.remote for r in rows)
    computed = sum(r.computed for r in rows)
    lines += ["", f"hit ratio        {cached / max(prompt, 1):.1%} of {prompt} prompt tokens came from "
                  f"cache (device {sum(r.device for r in rows)}, host {sum(r.host for r in rows)}, "
                  f"L3 {sum(r.remote for r in rows)})",
              f"prefill saved    {prompt - computed} of {prompt} prompt tokens were not computed "
              f"({sum(r.in_flight for r in rows)} of them shared with a sibling still in flight)"]
    return "\n".join(lines + ["", "answers (shortened)"] + answers(rows))


def answers(rows: list[Row], width: int = 88) -> list[str]:
    """One line per request: its answer on one line, cut to `width` characters."""
    out = []
    for r in rows:
        text = " ".join(r.answer.split())
        text = text if len(text) <= width else text[:width - 1] + "…"
        out.append(f"  {r.name:<14}{text!r}")
    return out
