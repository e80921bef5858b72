"""Writes tests/data/bpe_tokenizer/: the demo model's tokenizer (stack/demo_checkpoint.py: a
small real byte-level BPE `tokenizer.json` and a `tokenizer_config.json` with a ChatML chat
template), for the tokenizer tests. Running it again reproduces the committed files byte for
byte (`--check` says whether they are current).

    .venv/bin/python scripts/make_test_tokenizer.py [--check]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stack.demo_checkpoint import chat_tokenizer_files

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "bpe_tokenizer"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the files are stale")
    args = parser.parse_args(argv)
    files = chat_tokenizer_files()
    if args.check:
        stale = [n for n, c in files.items()
                 if not (OUT / n).is_file() or (OUT / n).read_text() != c]
        print(f"stale: {', '.join(stale)}" if stale else "up to date")
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (OUT / name).write_text(content)
    print(f"wrote {', '.join(files)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
