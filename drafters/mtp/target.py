"""What MTP drafters read of the loaded target: its input embedding (with the scale its forward
applies), its lm_head, its final norm, its last decoder layer and its checkpoint tensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...hooks.api import loading, taps
from ..base import DrafterError

_INNER = ("model", "backbone", "transformer")


def _inner(model: nn.Module) -> Tuple[nn.Module, nn.Module]:
    """(owner of the lm_head, decoder stack with embed_tokens and norm): model.model, or model.language_model.model."""
    for owner in (getattr(model, "language_model", None), model):
        for name in _INNER:
            inner = getattr(owner, name, None) if owner is not None else None
            if isinstance(inner, nn.Module) and isinstance(getattr(inner, "embed_tokens", None), nn.Module):
                return owner, inner
    raise DrafterError(f"cannot find the target's embed_tokens on {type(model).__module__}.{type(model).__name__} "
                       f"(expected model.{{{', '.join(_INNER)}}}.embed_tokens or model.language_model.model.embed_tokens)")


def embedding(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """Token ids -> the target's input embeddings, scaled as its forward scales them (Gemma: sqrt(hidden))."""
    _, inner = _inner(model)
    scale = getattr(inner, "embed_scale", None)
    embed = inner.embed_tokens
    return embed if scale is None else (lambda ids: embed(ids) * scale)


def lm_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's output head on final normed hidden states (tied or not; Gemma's softcapping included)."""
    owner, inner = _inner(model)
    head = getattr(owner, "lm_head", None)
    if head is None:
        tied = getattr(getattr(owner, "args", None), "tie_word_embeddings", True)
        if not tied:
            raise DrafterError(f"{type(model).__name__} has untied embeddings but no lm_head")
        head = inner.embed_tokens.as_linear
    cap = getattr(owner, "final_logit_softcapping", None)
    return head if not cap else (lambda h: mx.tanh(head(h) / cap) * cap)


def final_norm(model: nn.Module) -> nn.Module:
    _, inner = _inner(model)
    norm = getattr(inner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise DrafterError(f"{type(model).__name__}: no final norm on its decoder stack (expected .norm)")
    return norm


def last_layer(model: nn.Module) -> int:
    """The target's last decoder layer (its output, after the final norm, is the final hidden state)."""
    return len(taps.decoder_layers(model)) - 1


def headers(path: Optional[Path]) -> Dict[str, loading.TensorHeader]:
    if path is None:
        return {}
    try:
        return loading.safetensors_headers(path, "checkpoint", required=False)
    except loading.CheckpointError:
        return {}


def file_format(f: Path) -> str:
    """A safetensors file's ``__metadata__.format`` ("mlx" for mlx-lm / mlx-vlm writes, "pt" for Hugging Face)."""
    with f.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(n)).get("__metadata__") or {}
    return str(meta.get("format", ""))


def read_tensors(path: Path, names: Iterable[str]) -> Dict[str, mx.array]:
    """These tensors only, from whichever shards hold them (mx.load is lazy: nothing else is read)."""
    heads = headers(path)
    wanted = [n for n in names if n in heads]
    out: Dict[str, mx.array] = {}
    for f in sorted({heads[n].file for n in wanted}):
        arrays = mx.load(str(f))
        out.update({n: arrays[n] for n in wanted if heads[n].file == f})
    return out


def same_dir(a: Optional[Path], b: Optional[Path]) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def missing(expected: List[str], present: Iterable[str]) -> List[str]:
    have = set(present)
    return [n for n in expected if n not in have]
