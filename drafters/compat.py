"""Compatibility checks shared by families: from config fields and tokenizer files, never repo names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Optional

from .base import Compatibility


def config_value(config: Dict[str, Any], key: str) -> Any:
    """A field of config.json, looking into ``text_config`` for multimodal checkpoints."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def check_vocab(target: Dict[str, Any], draft: Dict[str, Any], verdict: Compatibility, field: str = "vocab_size") -> None:
    t, d = config_value(target, "vocab_size"), config_value(draft, field)
    if d is None:
        verdict.notes.append(f"draft {field}: not given (assumed the target's {t})")
    elif t is not None and d != t:
        verdict.fail(f"{field}: the drafter has {d}, the target has {t}; they must be equal")
    else:
        verdict.notes.append(f"{field}: {d} on both")


def _vocab_digest(path: Optional[Path]) -> Optional[str]:
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data.get("model", {}).get("vocab")
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", []))
    blob = json.dumps([sorted(vocab.items()) if isinstance(vocab, dict) else vocab, added])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_tokenizer(target_path: Optional[Path], draft_path: Optional[Path], verdict: Compatibility) -> None:
    t, d = _vocab_digest(target_path), _vocab_digest(draft_path)
    if d is None or t is None:
        verdict.notes.append("tokenizer: not compared (no tokenizer.json on one side)")
    elif d != t:
        verdict.fail(f"tokenizer: the drafter's tokenizer.json vocabulary (digest {d}) differs from the target's ({t})")
    else:
        verdict.notes.append(f"tokenizer: same vocabulary (digest {t})")
