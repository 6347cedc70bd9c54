"""The DFlash drafter's input features from the target's captured layer outputs: ONE function,
used by training (``drafters/dflash/train.py``) and decoding alike, so both read the same thing.

A DFlash ``target_layer_id`` i names the output of decoder layer i, i.e. Hugging Face's
``hidden_states[i + 1]``. HF takes ``hidden_states[N]`` (the last layer, N layers) after the
target's final norm, so a tap on the last layer is normed here, as z-lab's reference reads it.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

FinalNorm = Tuple[int, Callable[[mx.array], mx.array]]  # (the target's last layer, its final norm)


def target_features(
    captures: Dict[int, mx.array], layers: Sequence[int], final_norm: Optional[FinalNorm] = None,
) -> mx.array:
    """[B, n, taps*H]: the captured outputs of ``layers`` ([B, n, H] each), concatenated in ``fc``'s
    input order; the last layer's output goes through the final norm first."""
    missing = [i for i in layers if i not in captures]
    if missing:
        raise RuntimeError(f"the target's forward did not capture layers {missing} (asked for {list(layers)})")
    parts = [captures[i] for i in layers]
    if final_norm is not None:
        last, norm = final_norm
        parts = [norm(h) if i == last else h for i, h in zip(layers, parts)]
    return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def final_norm_tap(model: nn.Module, layers: Sequence[int]) -> Optional[FinalNorm]:
    """``(last layer, final norm)`` when ``layers`` include the target's last decoder layer, else None."""
    from ...hooks.api import decoder_layers
    from ..target_parts import target_final_norm

    last = len(decoder_layers(model)) - 1
    return (last, target_final_norm(model)) if last in layers else None
