"""What drafters borrow from the loaded target model: its token embedding, output head and final norm.

Found by name on mlx-lm's decoder stacks (``model.model``, ``model.backbone`` of mamba-style models,
``model.language_model.model`` of multimodal wrappers), never copied: drafters call the target's own
modules, so a quantized target lends its quantized embedding and head.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from .base import DrafterError

_INNER = ("model", "backbone", "transformer")  # where mlx-lm's models keep their decoder stack
_EMBED = ("embed_tokens", "embeddings", "wte")
_NORM = ("norm", "norm_f", "ln_f")


def _stacks(model: nn.Module) -> List[Tuple[nn.Module, nn.Module]]:
    """(owner, decoder stack) pairs: model.model, model.backbone (mamba), model.language_model.model..."""
    out = []
    for owner in (getattr(model, "language_model", None), model):
        for name in _INNER:
            inner = getattr(owner, name, None) if owner is not None else None
            if isinstance(inner, nn.Module):
                out.append((owner, inner))
    return out


def target_embedding_and_head(model: nn.Module) -> Tuple[nn.Module, Callable[[mx.array], mx.array]]:
    """The loaded mlx-lm target's token embedding and output head (tied or not)."""
    for owner, inner in _stacks(model):
        embed = next((getattr(inner, n) for n in _EMBED if isinstance(getattr(inner, n, None), nn.Module)), None)
        if embed is None:
            continue
        head = getattr(owner, "lm_head", None)
        if head is not None:
            return embed, head
        tied = getattr(getattr(owner, "args", None), "tie_word_embeddings", True)
        if not tied:
            break
        return embed, embed.as_linear
    raise DrafterError(
        f"cannot find the target's embedding and lm_head on {type(model).__module__}.{type(model).__name__}: expected "
        f"one of {', '.join(_EMBED)} on model.{{{', '.join(_INNER)}}} and an lm_head or tied embeddings"
    )


def target_final_norm(model: nn.Module) -> Callable[[mx.array], mx.array]:
    for _, inner in _stacks(model):
        norm = next((getattr(inner, n) for n in _NORM if isinstance(getattr(inner, n, None), nn.Module)), None)
        if norm is not None:
            return norm
    raise DrafterError(
        f"a target_layer_id names the target's last layer, whose HF hidden state is taken after the final "
        f"norm, but {type(model).__name__} has none of {', '.join(_NORM)} on its decoder stack"
    )
