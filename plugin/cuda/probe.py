"""Where MLX runs: the device checks the CUDA backend's settings and kernels ask (mlx.core only, so that the
selector, plugin/cuda/__init__.py, and the standalone kernel check, bench/gpu_attention_check.py, load it alone)."""

from __future__ import annotations

import mlx.core as mx


def device() -> str:
    """'cuda', 'metal' or 'cpu': where the default device runs ('gpu': another GPU backend)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    return "metal" if mx.metal.is_available() else "gpu"


def available() -> bool:
    """True where the kernels can run: MLX built with CUDA and the GPU as the default device."""
    cuda = getattr(mx, "cuda", None)  # absent from MLX builds without CUDA
    try:
        return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)
    except (AttributeError, RuntimeError):
        return False
