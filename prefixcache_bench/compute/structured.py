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

import glob
import json
import sys
from pathlib import Path

import torch

from compute_service.engine import SamplingParams
from compute_service.engine.grammar import GrammarEngine
from compute_service.engine.request import Request
from compute_service.engine.sampling import Constraint
from compute_service.model.model import CausalLM
from prefixcache_bench.compute.decode_modes import (arguments, build, decode_tok_s, in_rotation,
                                                    median_ms, rates_and_ratios, set_threads)
from prefixcache_bench.harness import Goal, machine_info, report
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


def mode_tok_s(model: CausalLM, tokenizer, constrained: bool, batch: int, tokens: int,
               rep: int) -> float:
    """Requests of `tokens` outputs at temperature 1, with the schema or plain (ignore_eos)."""
    extra = (dict(constraint=Constraint("json_schema", json.dumps(SCHEMA))) if constrained
             else dict(ignore_eos=True))
    rate, outs = decode_tok_s(model, tokenizer, lambda i: SamplingParams(
        max_tokens=tokens, temperature=1.0, seed=i + rep, **extra), batch, rep, first_id=3)
    counts = [len([t for o in out for t in o.token_ids]) for out in outs]
    assert counts == [tokens] * batch, counts  # no request ended early: equal batches
    return rate


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
    return median_ms(lambda: grammar.mask(logits, reqs), iters, warmup=5)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    threads, why = set_threads(args.threads)
    tokenizer = train_tokenizer(args.vocab)
    model = build(args.preset, args.vocab)
    for constrained in (False, True):  # warm-up (and the schema's compilation)
        mode_tok_s(model, tokenizer, constrained, 2, 8, 0)
    runs = in_rotation(["plain", "json_schema"], args.reps, lambda mode, rep: mode_tok_s(
        model, tokenizer, mode == "json_schema", args.batch, args.tokens, rep))
    results: dict = rates_and_ratios(runs)
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
