"""The plugin's CUDA backend: what it does for speed on MLX-CUDA, behind the host's ``Backend`` (hooks/backend.py).

Modules: ``backend`` (the backends: ``ShapeStablePolicy``'s padded caches, verify widths and prewarms; ``RoutedPolicy``),
``ragged_cache`` (a batch's rows at their own lengths), ``compiled`` (verify forwards and drafters' calls through
``mx.compile``), ``attention`` and ``projections`` (the dispatchers the host routes a model through), their kernels
``cuda_attention`` / ``cuda_attention_src`` (short-query attention) and ``cuda_matmul`` / ``cuda_qmatmul``
(verify-width matmuls), ``verify_ahead`` (the next round's verify built before this one's outcome is read) and
``probe`` (the device checks).

The plugin asks ``backend_for()`` once per target. This module decides from the settings and the device alone; only
where something is on does it import the rest, so on CPU and Metal with the defaults nothing else here is loaded but
``probe`` and ``verify_ahead`` (which the round imports; it asks only for a forward's ``forward_ahead``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx

from ...hooks.api import knobs
from .probe import available, device

if TYPE_CHECKING:
    from ...hooks.api import Backend

PADDED_ENV = "MLX_SPEC_PADDED_CACHE"
MODES = ("auto", "on", "off")


def padded_on(mode: Optional[str] = None) -> bool:
    """Whether padded caches are on: ``mode``, else ``runtime.padded_cache`` / $MLX_SPEC_PADDED_CACHE (hooks/knobs.py);
    'auto' = CUDA only."""
    mode = (mode or knobs.value("padded_cache")).strip().lower()
    if mode not in MODES:
        raise ValueError(f"{PADDED_ENV}: got {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "auto":
        return device() not in ("cpu", "metal")
    return mode == "on"


def kernel_mode(mode: Optional[str], knob: str, source: str, what: str) -> bool:
    """A CUDA kernel's auto | on | off setting: ``mode``, else the runtime knob ``knob`` (its YAML key, its
    variable: hooks/knobs.py), else auto (on where MLX runs on CUDA). ``source`` names an explicit ``mode``."""
    if not mode:
        mode, _, source = knobs.setting(knob)
    mode = mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"{source}: got {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "on" and not available():
        raise ValueError(f"{source} on: {what} needs MLX built with CUDA and the GPU as the default "
                         f"device; this process runs on {mx.default_device()} (allowed here: auto, off)")
    return available() if mode == "auto" else mode == "on"


ATTENTION_ENV = "MLX_SPEC_ATTENTION_KERNEL"
PROJECTION_ENV = "MLX_SPEC_PROJECTION_KERNEL"


def backend_for(mode: Optional[str] = None, attention_mode: Optional[str] = None) -> Optional[Backend]:
    """The target's backend (``backend.policy_for``: padded caches where ``mode`` / $MLX_SPEC_PADDED_CACHE says so, the
    attention and projection dispatchers and compiled forwards where theirs do), or None: mlx-lm's caches, attention
    and matmuls. The settings are checked here first, in the same order and with the same errors, so that nothing
    else of this package is imported where all of them are off."""
    if not (padded_on(mode) or kernel_mode(attention_mode, "attention_kernel", ATTENTION_ENV, "the attention kernel")
            or kernel_mode(None, "projection_kernel", PROJECTION_ENV, "the projection kernel")):
        return None
    from .backend import policy_for

    return policy_for(mode, attention_mode)
