"""Hidden-state taps on mlx-lm's own decoder stacks.

A tapped layer keeps its class, weights and parameter names; only its ``__call__`` also records
its output while a recorder is active. This is how drafters that read hidden states (DFlash, EAGLE-3, MTP) get the
target's hidden states from the ordinary forward, without any copied model code.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Sequence

import mlx.core as mx
import mlx.nn as nn

_local = threading.local()
_tapped_classes: Dict[type, type] = {}


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The target's decoder layer list (the object the model iterates over)."""
    for owner in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        if owner is None:
            continue
        layers = getattr(owner, "layers", None)
        if isinstance(layers, list) and layers:
            return layers
    inner = getattr(getattr(model, "language_model", None), "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), list):
        return inner.layers
    raise TypeError(
        f"cannot find the decoder layers of {type(model).__module__}.{type(model).__name__}: "
        "expected a list attribute `layers` on the model, model.model or model.language_model"
    )


def _tapped_class(cls: type) -> type:
    if cls in _tapped_classes:
        return _tapped_classes[cls]

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, *args, **kwargs)
        recorder = getattr(_local, "recorder", None)
        layer_id = self.__dict__.get("_spec_tap_id")
        if recorder is not None and layer_id in recorder:
            recorder[layer_id].append(out[0] if isinstance(out, tuple) else out)
        return out

    tapped = type(cls.__name__, (cls,), {"__call__": __call__, "_spec_tapped": True})
    tapped.__module__ = cls.__module__
    tapped.__qualname__ = cls.__qualname__
    _tapped_classes[cls] = tapped
    return tapped


def install_taps(model: nn.Module, layer_ids: Sequence[int]) -> None:
    """Make the given decoder layers recordable (idempotent)."""
    layers = decoder_layers(model)
    for i in layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(
                f"capture layer {i} is outside the target's decoder layers (0..{len(layers) - 1})"
            )
        layer = layers[i]
        if not getattr(type(layer), "_spec_tapped", False):
            layer.__class__ = _tapped_class(type(layer))
        # Stored in __dict__ directly: nn.Module's __setattr__ would register it as a parameter.
        layer.__dict__["_spec_tap_id"] = i


@contextlib.contextmanager
def record(layer_ids: Sequence[int]) -> Iterator[Dict[int, List[mx.array]]]:
    """Record the outputs of tapped layers during the forwards run inside the block."""
    previous = getattr(_local, "recorder", None)
    recorder: Dict[int, List[mx.array]] = {i: [] for i in layer_ids}
    _local.recorder = recorder if layer_ids else None
    try:
        yield recorder
    finally:
        _local.recorder = previous
