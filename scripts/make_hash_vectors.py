"""Writes tests/data/page_hash_vectors.json from a deliberately naive, independent implementation
of design.md §3 (struct per token, full digest then truncation), so the conformance test checks
cache_service.hash against a second reading of the spec rather than against itself."""
import hashlib
import json
import pathlib
import random
import struct

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "page_hash_vectors.json"


def field(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def naive(model: str, adapter: str, salt: str, page_size: int, tokens: list[int]) -> list[str]:
    parent = hashlib.sha256(b"prefixcache-ns-v1" + field(model) + field(adapter) + field(salt)).digest()[:16]
    out = []
    for p in range(len(tokens) // page_size):
        h = hashlib.sha256()
        h.update(parent)
        for t in tokens[p * page_size:(p + 1) * page_size]:
            h.update(struct.pack("<I", t))
        parent = h.digest()[:16]
        out.append(parent.hex())
    return out


def main() -> None:
    rng = random.Random(20261121)
    namespaces = [("m", "", ""), ("", "", ""), ("llama-3-8b", "sql-lora", ""),
                  ("llama-3-8b", "", "tenant-a"), ("模型", "адаптер", "ソルト🔑"),
                  ("m", "a", "b"), ("m", "ab", ""), ("m", "", "ab")]
    cases = []
    for model, adapter, salt in namespaces:
        for page_size in (1, 16, 64):
            n = rng.choice([0, page_size - 1, page_size, 3 * page_size + 5]) if page_size > 1 else 5
            tokens = [rng.choice([0, 1, 255, 65535, 2**31, 2**32 - 1, rng.randrange(2**32)])
                      for _ in range(n)]
            cases.append({"model_id": model, "adapter": adapter, "salt": salt,
                          "page_size": page_size, "tokens": tokens,
                          "namespace_seed": hashlib.sha256(
                              b"prefixcache-ns-v1" + field(model) + field(adapter) + field(salt)
                          ).digest()[:16].hex(),
                          "page_hashes": naive(model, adapter, salt, page_size, tokens)})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"spec": "design.md §3 prefixcache-ns-v1", "cases": cases}, indent=1,
                              ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
