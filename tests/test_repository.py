"""The repository stands alone: nothing in it needs a folder beside it, and every citation of the
design document names a section or lesson that exists in `docs/design.md`; modules and functions
stay small (design.md §8)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
# Where design citations live: sources, protos, docs and tests (generated code has none).
CITING = (".py", ".proto", ".md", ".sh", ".yaml", ".txt")
SECTION = re.compile(r"design\.md\s+(?:§(\d+)(?:\.\d+)?|lessons?\s+(\d+)(?:(?:, | and )(\d+))*)", re.I)


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None


def design_sections_and_lessons() -> tuple[set[int], set[int]]:
    text = DESIGN.read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}
    lessons_part = text.split("## 7. ", 1)[1].split("\n## ", 1)[0]
    lessons = {int(n) for n in re.findall(r"^(\d+)\. \*\*", lessons_part, re.M)}
    return sections, lessons


def test_the_design_document_has_its_eight_sections_and_fourteen_lessons():
    sections, lessons = design_sections_and_lessons()
    assert sections == set(range(1, 9))
    assert lessons == set(range(1, 15))


def test_nothing_refers_to_a_folder_outside_the_repository():
    offenders = []
    for path in tracked_files():
        text = text_of(path)
        if path != Path(__file__) and text is not None and ("../shared" in text
                                                            or "shared/traces" in text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == [], f"these files point outside the repository: {offenders}"


def test_every_design_citation_names_a_section_or_lesson_that_exists():
    sections, lessons = design_sections_and_lessons()
    bad, old_style, cited = [], [], 0
    for path in tracked_files():
        if path.suffix not in CITING or path in (DESIGN, Path(__file__)):
            continue  # the design document itself, and this test's own patterns
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(REPO)
        if re.search(r"\bDESIGN(\.md)?\b", text):
            old_style.append(str(rel))
        for m in SECTION.finditer(text):
            cited += 1
            if m.group(1) and int(m.group(1)) not in sections:
                bad.append(f"{rel}: {m.group(0)}")
            for n in filter(None, m.groups()[1:]):
                if int(n) not in lessons:
                    bad.append(f"{rel}: {m.group(0)}")
        # A bare "lesson N" (one left once the citations are taken out) must say where it lives.
        for m in re.finditer(r"\blessons?\s+(\d+)\b", SECTION.sub("", text), re.I):
            bad.append(f"{rel}: bare '{m.group(0)}' (write 'design.md lesson N')")
    assert old_style == [], f"cite docs/design.md, not DESIGN: {old_style}"
    assert bad == []
    assert cited > 20  # the code does cite it


LONG_MODULE = "Longer than 400 lines:"


def test_modules_stay_small_or_say_why_at_the_top():
    """design.md §8: about 400 lines at most, or a reason written at the top."""
    long = []
    for path in tracked_files():
        rel = path.relative_to(REPO)
        if path.suffix != ".py" or rel.parts[0] == "prefixcache" or not path.exists():
            continue  # prefixcache/ is generated code
        lines = path.read_text().splitlines()
        if len(lines) > 420 and not any(LONG_MODULE in line for line in lines[:40]):
            long.append(f"{rel} ({len(lines)} lines)")
    assert long == [], f"split these or say why at the top ('{LONG_MODULE} ...'): {long}"


MAX_FUNCTION_LINES = 80


def python_sources() -> list[Path]:
    """Tracked .py files outside generated code (prefixcache/, scripts/gen_protos.py writes it) and
    outside a virtual environment."""
    return [path for path in tracked_files() if path.suffix == ".py" and path.exists()
            and path.relative_to(REPO).parts[0] not in ("prefixcache", ".venv")]


def long_functions(paths: list[Path], root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (N lines)` for every function or method (nested ones too) longer than
    `limit` lines, from its `def` line to its last line (decorators not counted)."""
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return long


VENDORED = "# Vendored from "  # a third party's code copied verbatim (and hash-checked): not ours to split


def test_no_function_is_longer_than_80_lines():
    """design.md §8: a long function becomes named steps (small functions, dataclasses)."""
    long = long_functions([p for p in python_sources()
                           if not any(line.startswith(VENDORED)
                                      for line in p.read_text(encoding="utf-8").splitlines()[:10])])
    assert long == [], f"split these functions ({MAX_FUNCTION_LINES} lines at most): {long}"


def test_the_function_length_check_names_each_offender(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(80))  # with its def: 81 lines
    just_fits = "\n".join(f"    y{i} = {i}" for i in range(79))  # with its def: 80 lines
    (tmp_path / "pkg").mkdir()
    planted = tmp_path / "pkg" / "planted.py"
    planted.write_text(f"def fits():\n{just_fits}\n\n\nclass C:\n    @staticmethod\n"
                       f"    async def too_long():\n{body}\n")
    assert long_functions([planted], root=tmp_path) == ["pkg/planted.py:85 too_long (81 lines)"]
