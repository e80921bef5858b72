"""A checkpoint's sampling defaults: generation_config.json's `temperature`, `top_k` and `top_p`,
which a request's unset sampling fields take (GetModelInfoResponse.sampling_defaults).

Only the fields the file sets are defaults; the others keep the service's own (greedy, no top-k,
no top-p), as vLLM reads the file. `do_sample: false` is honoured as transformers honours it:
the model's default is greedy (temperature 0) whatever temperature the file also names. A value
outside the range a request may send fails loading, naming the file and the field, rather than
failing every request that leaves the field unset.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Defaults for the sampling fields a request leaves unset; None = the service's own."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


def _number(d: dict[str, Any], key: str, where: Path) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} {key}: must be a number, got {value!r}")
    return value


def sampling_defaults(d: dict[str, Any], vocab_size: int,
                      where: Path = Path(GENERATION_CONFIG)) -> SamplingDefaults:
    """The defaults of a generation_config.json dict (see the module docstring)."""
    if d.get("do_sample") is False:
        return SamplingDefaults(temperature=0.0)
    temperature, top_k, top_p = (_number(d, k, where) for k in ("temperature", "top_k", "top_p"))
    if temperature is not None and not 0 <= temperature <= 100:
        raise ValueError(f"{where} temperature: must be in [0, 100], got {temperature}")
    if top_k is not None and (top_k != int(top_k) or not 0 <= top_k <= vocab_size):
        raise ValueError(f"{where} top_k: must be an integer in [0, {vocab_size}], got {top_k}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"{where} top_p: must be in [0, 1], got {top_p}")
    return SamplingDefaults(None if temperature is None else float(temperature),
                            None if top_k is None else int(top_k),
                            None if top_p is None else float(top_p))


def read_sampling_defaults(path: str | Path, vocab_size: int) -> SamplingDefaults:
    """The defaults of checkpoint directory `path` (none without generation_config.json)."""
    file = Path(path) / GENERATION_CONFIG
    if not file.is_file():
        return SamplingDefaults()
    try:
        d = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    return sampling_defaults(d, vocab_size, file)
