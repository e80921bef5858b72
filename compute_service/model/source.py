"""What `--model` names, resolved before anything is loaded:

- a preset (`tiny-*`, `small-*`): random weights built here;
- a GGUF file, or a directory holding one .gguf and no config.json (`gguf_checkpoint`);
- a directory with an HF checkpoint (config.json + safetensors);
- a Hugging Face hub id `org/name[@revision]`: resolved through `huggingface_hub` from its local
  cache first (`snapshot_download(..., local_files_only=True)`), downloaded where the network
  allows; offline and not cached is a `ModelNotFoundError` naming the cache directory it looked in.

A spec that is none of these is a `ModelNotFoundError` (a ValueError) saying what was tried.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from compute_service.model.gguf_checkpoint import find_gguf
from compute_service.model.presets import PRESETS

__all__ = ["ModelNotFoundError", "ModelSource", "resolve_model"]

# org/name[@revision], with the characters the hub allows in repo ids.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
# What a worker needs from a repo: the checkpoint and its tokenizer and configs.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]


class ModelNotFoundError(ValueError):
    """`--model` names nothing this worker can load."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "preset" | "gguf" | "hf"
    spec: str  # what --model said
    path: Path | None = None  # the file (gguf) or directory (hf)

    @property
    def name(self) -> str:
        """A model id for a checkpoint: its directory's name, a GGUF file's stem, a hub repo's
        name (org/name)."""
        if self.kind == "preset":
            return self.spec
        match = _HUB_ID.match(self.spec)
        if match and not Path(self.spec).exists():
            return match.group("repo")
        return self.path.stem if self.kind == "gguf" else self.path.resolve().name


def resolve_model(spec: str) -> ModelSource:
    """The source `spec` names (see the module docstring)."""
    if spec in PRESETS:
        return ModelSource("preset", spec)
    path = Path(spec).expanduser()
    gguf = find_gguf(path)
    if gguf is not None:
        return ModelSource("gguf", spec, gguf)
    if (path / "config.json").is_file():
        return ModelSource("hf", spec, path)
    if path.exists():
        raise ModelNotFoundError(f"--model {spec}: neither a .gguf file nor a directory with "
                                 "config.json or a .gguf file")
    match = _HUB_ID.match(spec)
    if match is None:
        raise ModelNotFoundError(f"--model {spec}: neither a preset ({', '.join(PRESETS)}), a "
                                 "path, nor a hub id org/name[@revision]")
    return resolve_model_dir(hub_snapshot(match.group("repo"), match.group("rev")), spec)


def resolve_model_dir(directory: Path, spec: str) -> ModelSource:
    gguf = find_gguf(directory)
    if gguf is not None:
        return ModelSource("gguf", spec, gguf)
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"--model {spec}: {directory} has no config.json nor .gguf file")
    return ModelSource("hf", spec, directory)


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The local snapshot directory of `repo` at `revision`: from the cache, else downloaded.
    ModelNotFoundError naming the cache directory when neither works."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True,
                                      allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        pass  # not cached: try the network below
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        at = f"@{revision}" if revision else ""
        raise ModelNotFoundError(
            f"--model {repo}{at}: not in the Hugging Face cache {constants.HF_HUB_CACHE} "
            f"(HF_HUB_CACHE / HF_HOME) and could not be downloaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); download it where a network "
            f"is reachable (huggingface-cli download {repo}) or pass a local directory") from exc
