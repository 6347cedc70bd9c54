"""The projection dispatcher the plugin hands the host: verify-width matmuls through one cheap kernel launch.

The host routes a loaded model's ``nn.Linear`` layers through ``CachePolicy.projections``
(hooks/attention.py ``route_projections``), so each call ``layer(x)`` asks ``Projections(x, weight)``
first. It answers x @ weight.T from plugin/cuda/cuda_matmul.py's kernel when the call has 2..16 rows
(verify forwards, drafter blocks, a round's new context) in bfloat16 or float16 with K a multiple of
8, and None otherwise: the layer then runs mlx's own code (one-token steps keep MLX's gemv, prefill
chunks cuBLAS). Biases are added by the routed layer. ``many(x, weights)`` multiplies the same x by
sibling layers' weights (q/k/v, gate/up: the routed layers learn which, hooks/attention.py) in one
launch, each product the bits a launch of its own gives. ``counts`` tallies the paths ("kernel": launches,
"fused": products served by another layer's launch, "mlx") for ``mlx-spec bench``.

Why (bench/results/kernels/h200-host-split*.json, H200): MLX-CUDA plans every 2+-row matmul with
cuBLASLt on the host, ~25 us a call against ~8 us for this kernel's launch, and a 16-position
forward of an 8B llama makes 225 of them: the host time of the verify forward, which a speculative
round waits for, drops by several milliseconds.

On by default where the kernel runs (MLX built with CUDA, GPU default device); off on CPU and Metal.
``MLX_SPEC_PROJECTION_KERNEL`` = auto | on | off overrides (on: an error where the kernel cannot run).

4-bit layers (``nn.QuantizedLinear``, affine, group 32 / 64 / 128): ``quantized(x, layer)`` answers from
plugin/cuda/cuda_qmatmul.py's kernel for 2..32 rows (one-token steps keep MLX's qmv). On by default where the
kernel runs, as the bf16 one; ``MLX_SPEC_QUANTIZED_KERNEL`` = auto | on | off overrides. On the H200 it
passes bench/gpu_qmatmul_check.py and a 4-bit 8B llama's 16-position forward drops from 17.8 to 8.3 ms at
4096 keys (bench/results/kernels/h200-qmatmul-check.json, attention/h200-attention-e2e-4bit-*-qkernel.json).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import PROJECTION_ENV, cuda_matmul, cuda_qmatmul, kernel_mode

ENV = PROJECTION_ENV
QUANTIZED_ENV = "MLX_SPEC_QUANTIZED_KERNEL"
# (x, w) -> (kernel, keyword arguments) or None: cuda_matmul.plan's contract
Planner = Callable[[mx.array, mx.array], Optional[Tuple[Any, Dict[str, Any]]]]
# (x, [w, ...]) -> the same for one launch over several weights: cuda_matmul.plan_many's contract
ManyPlanner = Callable[[mx.array, Sequence[mx.array]], Optional[Tuple[Any, Dict[str, Any]]]]
# (x, an nn.QuantizedLinear) -> (kernel, keyword arguments) or None; the launch takes [x, weight, scales, biases]
QuantizedPlanner = Callable[[mx.array, Any], Optional[Tuple[Any, Dict[str, Any]]]]


def plan_quantized(x: mx.array, layer: Any) -> Optional[Tuple[Any, Dict[str, Any]]]:
    """cuda_qmatmul.plan for an ``nn.QuantizedLinear``'s arrays."""
    return cuda_qmatmul.plan(x, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                             getattr(layer, "mode", "affine"))


class Projections:
    """``(x, weight) -> x @ weight.T`` for routed ``nn.Linear`` layers, or None (the layer's own matmul)."""

    def __init__(self, planner: Planner = cuda_matmul.plan, name: str = "cuda_matmul.mm",
                 planner_many: Optional[ManyPlanner] = cuda_matmul.plan_many,
                 planner_quantized: Optional[QuantizedPlanner] = None):
        self.planner = planner
        self.planner_many = planner_many
        self.planner_quantized = planner_quantized
        self.routes_quantized = planner_quantized is not None  # the host routes nn.QuantizedLinear too
        self.max_weights = cuda_matmul.MAX_WEIGHTS
        self.name = name
        # The routed layers ask only for inputs of these many rows. bf16/f16 up to 16: at 32 rows (a batch of two
        # 16-position verifies) the kernel's forward of an 8B llama took 12.2 ms on an H100 against 9.3 with MLX's
        # own matmuls (9.0 against 9.1 at 16 rows; bench/results/served/h100-batch-steps*.json), and 2-client
        # served rounds paid it. 4-bit layers keep 2..32 (MLX's quantized matmul is the slow one there).
        self.rows = (2, 16)
        self.quantized_rows = (2, cuda_matmul.MAX_ROWS)
        self.enabled = True
        self.counts: Counter = Counter()

    def __call__(self, x: mx.array, w: mx.array) -> Optional[mx.array]:
        launch = self.planner(x, w) if self.enabled else None
        if launch is None:
            self.counts["mlx"] += 1
            return None
        self.counts["kernel"] += 1
        kernel, args = launch
        return kernel(inputs=[x, w], **args)[0]

    def many(self, x: mx.array, ws: Sequence[mx.array]) -> Optional[List[mx.array]]:
        """[x @ w.T for w in ws] from one launch, or None (each layer then runs on its own)."""
        launch = self.planner_many(x, ws) if self.enabled and self.planner_many is not None else None
        if launch is None:
            return None
        self.counts["kernel"] += 1
        self.counts["fused"] += len(ws) - 1
        kernel, args = launch
        return kernel(inputs=[x, *ws], **args)

    def quantized(self, x: mx.array, layer: Any) -> Optional[mx.array]:
        """x @ dequantize(layer).T for a routed ``nn.QuantizedLinear``, or None (the layer's own)."""
        launch = self.planner_quantized(x, layer) if self.enabled and self.planner_quantized is not None else None
        if launch is None:
            self.counts["mlx"] += 1
            return None
        self.counts["kernel"] += 1
        self.counts["quantized"] += 1
        kernel, args = launch
        return kernel(inputs=[x, layer["weight"], layer["scales"], layer["biases"]], **args)[0]

    def report(self) -> Dict[str, Any]:
        total = self.counts["kernel"] + self.counts["fused"] + self.counts["mlx"]  # products ("quantized": of the kernel's)
        return {"kernel": self.name, "enabled": self.enabled, "calls": dict(self.counts),
                "kernel_share": round(self.counts["kernel"] / total, 4) if total else None}


def stand_in(quantized: bool = False) -> Projections:
    """A dispatcher with the kernel's contract on any device (float32 MLX matmul, any float dtype):
    exercises the routing where the kernel cannot run (the CPU tests). ``quantized``: 4-bit layers too
    (cuda_qmatmul.reference)."""

    def planner_many(x: mx.array, ws: Sequence[mx.array]) -> Optional[Tuple[Any, Dict[str, Any]]]:
        rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        if not 1 <= len(ws) <= cuda_matmul.MAX_WEIGHTS or not 2 <= rows <= cuda_matmul.MAX_ROWS or \
                any(w.ndim != 2 or x.shape[-1] != w.shape[1] for w in ws):
            return None
        return (lambda inputs: [cuda_matmul.reference(inputs[0], w) for w in inputs[1:]]), {}

    def planner_quantized(x: mx.array, layer: Any) -> Optional[Tuple[Any, Dict[str, Any]]]:
        rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        if not 2 <= rows <= cuda_matmul.MAX_ROWS or layer.bits != cuda_qmatmul.BITS or "biases" not in layer or \
                layer.group_size not in cuda_qmatmul.GROUP_SIZES or getattr(layer, "mode", "affine") != "affine":
            return None
        return (lambda inputs: [cuda_qmatmul.reference(*inputs, layer.group_size)]), {}

    return Projections(lambda x, w: planner_many(x, [w]), "cuda_matmul.reference", planner_many,
                       planner_quantized if quantized else None)


def resolve_mode(mode: Optional[str] = None, source: str = ENV) -> bool:
    """Whether projections are routed: ``mode`` (or $MLX_SPEC_PROJECTION_KERNEL); auto = where the kernel runs."""
    return kernel_mode(mode, "projection_kernel", source, "the projection kernel")


def quantized_on() -> bool:
    """$MLX_SPEC_QUANTIZED_KERNEL = auto | on | off (default auto: where the kernel runs): whether 4-bit
    layers are routed too."""
    return kernel_mode(None, "quantized_kernel", QUANTIZED_ENV, "the 4-bit kernel")


def projections_for(mode: Optional[str] = None, source: str = ENV) -> Optional[Projections]:
    """The CUDA kernel's dispatcher where the mode says so, else None (mlx's matmuls)."""
    if not resolve_mode(mode, source):
        return None
    return Projections(planner_quantized=plan_quantized if quantized_on() else None)
