"""The drafter's input features from the target's captured layer outputs: ONE definition, used by
decoding (``DFlashBatch``) and by training, so that both read the same thing."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx


def target_features(
    captures: Dict[int, mx.array], layers: Sequence[int], final_norm: Optional[Tuple[int, Callable[[mx.array], mx.array]]],
) -> mx.array:
    """Concatenate the outputs of ``layers`` (fc's input order): {layer: [B, n, H]} -> [B, n, taps*H].

    ``final_norm``: (the target's last layer, its final norm) when a tap reads the last layer,
    whose Hugging Face hidden state (``hidden_states[N]``) is taken after the final norm.
    """
    missing = [i for i in layers if i not in captures]
    if missing:
        raise RuntimeError(f"the target's forward did not capture layers {missing} (asked for {list(layers)})")
    parts = [captures[i] for i in layers]
    if final_norm is not None:
        parts = [final_norm[1](h) if i == final_norm[0] else h for i, h in zip(layers, parts)]
    return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
