"""The committed generated code must be what `python scripts/gen_protos.py` produces now."""
import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "prefixcache").rglob("*") if p.is_file())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "prefixcache").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert fresh == committed, "generated file set differs: run python scripts/gen_protos.py"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"stale generated code {stale}: run python scripts/gen_protos.py"
