"""Decode tokens/s with a JSON schema (structured output: compute_service/engine/grammar.py's
xgrammar mask in the sampler) over plain decoding, in the same run.

    .venv/bin/python -m prefixcache_bench.compute.structured [--preset small-transformer] \\
        [--vocab 32000] [--batch 8] [--tokens 64] [--json docs/results/compute/structured_output.json]

The engine on CPU with the in-process cache service and `--batch` requests of `--tokens` output
tokens each at temperature 1, over a byte-level BPE tokenizer of `--vocab` ids trained here on
this repository's own text (the mask's cost grows with the vocabulary and with how many of its
tokens a grammar state must test: a byte tokenizer's 256 single bytes would make it look free);
the preset's model is widened to that vocabulary. The schema is an object with an integer, an
enum and a string of at least 400 characters, so no constrained request can end before
`--tokens` (plain ones run with ignore_eos): both modes decode the same number of tokens in
batches of the same size. Modes alternate, `--reps` times each; a figure is the median of its
runs' decode tokens/s (output tokens after the first over the time from the first to the
last); the ratio is the median over reps of schema / plain of the same rep. `mask_ms_per_step`
times the mask alone (fill + apply) for one step's batch, the cost the two rates differ by.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import sys
import time
from pathlib import Path

import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.engine.grammar import GrammarEngine
from compute_service.engine.request import Request
from compute_service.engine.sampling import Constraint
from compute_service.model.model import CausalLM
from compute_service.model.presets import init_random_, preset_config
from prefixcache_bench.harness import Goal, choose_threads, machine_info, percentile, report
from prefixcache_client.tokenizer import from_files

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "kind": {"enum": ["note", "todo", "idea"]},
    "text": {"type": "string", "minLength": 400}}, "required": ["id", "kind", "text"],
    "additionalProperties": False}
GOALS = {"json_schema_ratio": Goal(">=", 0.8)}
REPO = Path(__file__).resolve().parents[2]


def train_tokenizer(vocab: int):
    """A byte-level BPE tokenizer.json of `vocab` ids (ids 0-2: bos, eos, pad) trained on the
    repository's Python and Markdown (deterministic for a given tree)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|bos|>", "<|eos|>",
                                                                   "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = sorted(glob.glob(str(REPO / "**" / "*.py"), recursive=True)
                   + glob.glob(str(REPO / "**" / "*.md"), recursive=True))
    tok.train([f for f in files if "/.venv/" not in f], trainer)
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    return from_files({"tokenizer.json": tok.to_str().encode(),
                       "tokenizer_config.json": json.dumps(config).encode()})


def build(preset: str, vocab: int) -> CausalLM:
    cfg = dataclasses.replace(preset_config(preset), vocab_size=vocab).validate()
    return init_random_(CausalLM.empty(cfg, torch.float32, "cpu"), seed=0).eval()


def decode_tok_s(model: CausalLM, tokenizer, constrained: bool, batch: int, tokens: int,
                 rep: int) -> float:
    eng = Engine(model, tokenizer, CacheCore(), EngineConfig(
        page_size=16, device_pages=1024, token_budget=2048, max_running=batch, model_id="m"))
    outs: list[list] = [[] for _ in range(batch)]
    extra = (dict(constraint=Constraint("json_schema", json.dumps(SCHEMA))) if constrained
             else dict(ignore_eos=True))
    for i, out in enumerate(outs):
        prompt = [(13 * j + 7 * i + rep) % 250 + 3 for j in range(64)]  # distinct prompts
        eng.submit(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i + rep,
                                          **extra), out.append)
    while not all(out for out in outs):  # prefill first (not measured)
        eng.step()
    first = time.perf_counter()
    eng.run_until_idle()
    elapsed = time.perf_counter() - first
    counts = [len([t for o in out for t in o.token_ids]) for out in outs]
    assert counts == [tokens] * batch, counts  # no request ended early: equal batches
    return sum(c - 1 for c in counts) / elapsed


def mask_ms(tokenizer, vocab: int, batch: int, iters: int = 100) -> float:
    """The mask alone for one step of `batch` constrained requests, each 40 tokens into the
    schema's string (the commonest state of a long output): ms per step, median of 5."""
    grammar = GrammarEngine(tokenizer, vocab, tokenizer.eos_token_ids)
    prefix = tokenizer.encode('{"id": 7, "kind": "note", "text": "the quick brown fox jumps')
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", [1], SamplingParams(constraint=Constraint(
            "json_schema", json.dumps(SCHEMA))), lambda o: None)
        r.output = list(prefix)
        reqs.append(r)
    logits = torch.randn(batch, vocab)
    for _ in range(5):
        grammar.mask(logits.clone(), reqs)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            grammar.mask(logits, reqs)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return percentile(times, 0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small-transformer")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads, why = choose_threads(args.threads, torch.get_num_threads())
    torch.set_num_threads(threads)
    tokenizer = train_tokenizer(args.vocab)
    model = build(args.preset, args.vocab)
    for constrained in (False, True):  # warm-up (and the schema's compilation)
        decode_tok_s(model, tokenizer, constrained, 2, 8, 0)
    runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]  # neither always first
        for constrained in order:
            runs["json_schema" if constrained else "plain"].append(
                decode_tok_s(model, tokenizer, constrained, args.batch, args.tokens, rep))
    med = {m: percentile(v, 0.5) for m, v in runs.items()}
    results: dict = {f"{m}_decode_tok_s": round(v, 1) for m, v in med.items()}
    results["json_schema_ratio"] = round(percentile(
        [x / y for x, y in zip(runs["json_schema"], runs["plain"], strict=True)], 0.5), 4)
    results["json_schema_ratio_of_medians"] = round(med["json_schema"] / med["plain"], 4)
    results["mask_ms_per_step"] = round(mask_ms(tokenizer, args.vocab, args.batch), 3)
    results.update(preset=args.preset, vocab=args.vocab, batch=args.batch,
                   output_tokens=args.tokens, reps=args.reps, threads=threads,
                   threads_why=why, schema=SCHEMA,
                   runs={m: [round(x, 1) for x in v] for m, v in runs.items()})
    command = "python -m prefixcache_bench.compute.structured " + " ".join(
        sys.argv[1:] if argv is None else argv)
    from importlib.metadata import version

    ok = report(results, GOALS, f"decode tokens/s with a JSON schema ({args.preset}, vocab "
                f"{args.vocab}, batch {args.batch})", command.strip(),
                machine_info({"torch": torch.__version__, "xgrammar": version("xgrammar")}),
                args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
