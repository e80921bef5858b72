"""A strict logfmt parser for the log tests, written from the format's definition (go-logfmt):
a line is `key=value` pairs separated by single spaces; a key is one or more characters other
than space, `=` and `"`; a value is empty, a run of such characters, or a double-quoted string
whose escapes are JSON's. Anything else (a bare word, a space inside a value, an unterminated
quote, a raw control character) is a ValueError naming the column."""
from __future__ import annotations

import json

_SEPARATORS = ' ="'


def _plain(c: str) -> bool:
    return c not in _SEPARATORS and c >= " " and c != "\x7f"


def parse(line: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    i, n = 0, len(line)
    if not line:
        raise ValueError("empty line")
    while i < n:
        start = i
        while i < n and _plain(line[i]):
            i += 1
        if i == start:
            raise ValueError(f"column {i}: expected a key, got {line[i:i + 10]!r}")
        key = line[start:i]
        if i >= n or line[i] != "=":
            raise ValueError(f"column {i}: key {key!r} without '='")
        i += 1
        if i < n and line[i] == '"':
            end = i + 1
            while end < n and line[end] != '"':
                if line[end] < " ":
                    raise ValueError(f"column {end}: raw control character in a quoted value")
                end += 2 if line[end] == "\\" else 1
            if end >= n:
                raise ValueError(f"column {i}: unterminated quoted value")
            value = json.loads(line[i:end + 1])  # JSON escapes only
            i = end + 1
        else:
            start = i
            while i < n and _plain(line[i]):
                i += 1
            value = line[start:i]
        if key in pairs:
            raise ValueError(f"key {key!r} twice")
        pairs[key] = value
        if i < n:
            if line[i] != " ":
                raise ValueError(f"column {i}: expected a space, got {line[i]!r}")
            i += 1
            if i == n:
                raise ValueError("trailing space")
    return pairs
