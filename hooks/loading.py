"""Finding and checking checkpoints: local paths or Hugging Face repo ids, offline-capable."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Dict

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what was expected and found."""


def resolve_path(spec: str, what: str = "model") -> Path:
    """A local directory for ``spec``: an existing path, or a repo id from the HF cache/hub.

    With ``HF_HUB_OFFLINE=1`` only the local cache is used.
    """
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{what} path {spec!r} is a file; expected a checkpoint directory")
        return path
    if not _REPO_ID.match(spec) or spec.startswith((".", "/", "~")):
        raise CheckpointError(
            f"{what} {spec!r} not found: expected an existing directory or a Hugging Face repo id "
            "like 'org/name'"
        )
    try:
        from huggingface_hub import snapshot_download

        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        return Path(snapshot_download(spec, allow_patterns=_PATTERNS, local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types
        raise CheckpointError(
            f"{what} {spec!r} is neither a local directory nor available as a Hugging Face repo "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def read_config(path: Path, what: str = "model") -> Dict[str, Any]:
    """config.json of a checkpoint, checked for a ``model_type``."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{what} {str(path)!r} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} config {str(config_file)!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{what} config {str(config_file)!r} must be a JSON object, got {type(config).__name__}")
    # speculators-format drafters keep model_type inside transformer_layer_config.
    if "model_type" not in config and "text_config" not in config and "speculators_model_type" not in config:
        raise CheckpointError(
            f"{what} config {str(config_file)!r} has no 'model_type'; expected e.g. "
            "\"model_type\": \"llama\""
        )
    return config


def check_safetensors(path: Path, what: str = "model") -> None:
    """Every *.safetensors file has a readable header (catches truncated or corrupt files)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{what} {str(path)!r} has no *.safetensors weights (only safetensors are loaded)")
    for f in files:
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit in a {size}-byte file")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {size}")
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{what} weights {str(f)!r} are not a valid safetensors file: {e}") from e
