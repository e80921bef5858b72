"""Regenerate the Python code of protos/ into prefixcache/ (the one way to do it).

    python scripts/gen_protos.py            # write into the repository
    python scripts/gen_protos.py --out DIR  # write elsewhere (the staleness test uses this)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Python packages need __init__.py files; protoc does not write them.
    for d in {out / p.parent for p in map(pathlib.Path, files)} | {out / "prefixcache"}:
        (d / "__init__.py").touch()
    return sorted(p for p in (out / "prefixcache").rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    args = parser.parse_args(argv)
    written = generate(args.out)
    print(f"generated {len(written)} files under {args.out / 'prefixcache'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
