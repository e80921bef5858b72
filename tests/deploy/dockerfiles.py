"""Just enough of the Dockerfile and .dockerignore formats to check the images' structure."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"


@dataclass(slots=True)
class Instruction:
    keyword: str                      # upper case: FROM, RUN, COPY, ...
    args: str                         # continuation lines joined
    comments: list[str] = field(default_factory=list)   # the comment lines just above it


@dataclass(slots=True)
class Stage:
    base: str                         # FROM's image with ARG defaults substituted
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass(slots=True)
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for s in self.stages for i in s.all(keyword)]


def parse(path: Path) -> Dockerfile:
    lines = path.read_text().splitlines()
    instructions: list[Instruction] = []
    comments: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line:
            comments = []
            continue
        if line.startswith("#"):
            comments.append(line.lstrip("#").strip())
            continue
        text = line
        while text.endswith("\\") and i < len(lines):
            text = text[:-1].rstrip() + " "
            nxt = lines[i].strip()
            i += 1
            if nxt.startswith("#"):
                continue   # comments inside a continued instruction are dropped by Docker
            text += nxt
        keyword, _, args = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), comments))
        comments = []

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not stages:
            name, _, default = ins.args.partition("=")
            global_args[name] = default
        elif ins.keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", ins.args, flags=re.IGNORECASE)
            assert m, ins.args
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                          lambda v: global_args[v.group(1) or v.group(2)], m.group(1))
            stages.append(Stage(base, m.group(2), []))
        elif stages:
            stages[-1].instructions.append(ins)
    return Dockerfile(path, stages)


def exec_form(ins: Instruction) -> list[str]:
    value = json.loads(ins.args)
    assert isinstance(value, list), f"{ins.keyword} must be in exec (JSON) form"
    return value


# --- .dockerignore -------------------------------------------------------------------------------

def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


class DockerIgnore:
    """Docker's rules: the last matching pattern wins, `!` re-includes, and a pattern that
    matches a directory matches everything under it."""

    def __init__(self, text: str):
        self.rules: list[tuple[bool, re.Pattern[str], str]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = os.path.normpath(line[1:] if negate else line).lstrip("/")
            self.rules.append((negate, _regex(pattern), pattern))

    def excluded(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for negate, regex, _ in self.rules:
            if any(regex.fullmatch(p) for p in prefixes):
                result = not negate
        return result

    def context_files(self, root: Path) -> list[str]:
        """Files of `root` that reach the build context."""
        negated = [p for neg, _, p in self.rules if neg]
        found = []
        for directory, dirs, files in os.walk(root):
            rel_dir = os.path.relpath(directory, root)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            # Prune excluded directories no `!` pattern reaches into.
            dirs[:] = [d for d in dirs if not self.excluded(rel_dir + d)
                       or any(p.startswith(rel_dir + d + "/") for p in negated)]
            found += [rel_dir + f for f in files if not self.excluded(rel_dir + f)]
        return sorted(found)
