"""Drafter checkpoint folders: their tensors into a family's own module (dflash, eagle3, the MTP
heads) and, for the checkpoints training writes, the target's tokenizer files beside them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn

from .base import DrafterError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


def read_tensors(path: Path) -> Dict[str, mx.array]:
    """Every tensor of a checkpoint folder's safetensors files."""
    weights: Dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def load_into(model: nn.Module, weights: Dict[str, mx.array], config: Dict[str, Any], path: Path, what: str) -> None:
    """Quantize ``model`` as the config says (the layers the checkpoint has scales for), load
    ``weights`` strictly, evaluate them, and set eval mode; ``what`` names the expected drafter in
    the error (e.g. "a DFlash drafter of this config")."""
    quant = config.get("quantization")
    if quant:
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DrafterError(f"draft model {str(path)!r}: its tensors do not match {what}: {e}") from e
    mx.eval(model.parameters())
    model.eval()


def copy_tokenizer(source: Path, out_dir: Path) -> List[str]:
    """The tokenizer files of ``source`` (the target) copied into ``out_dir``; their names."""
    written = []
    for f in TOKENIZER_FILES:
        if (source / f).is_file():
            shutil.copy(source / f, out_dir / f)
            written.append(f)
    return written
