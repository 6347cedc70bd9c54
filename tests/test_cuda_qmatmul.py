"""The verify-width 4-bit projection kernel's contract on the CPU: what it declines (before any kernel is
built) and its reference. The kernel itself runs on the GPU only (bench/gpu_qmatmul_check.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlx_speculative.plugin.cuda import cuda_qmatmul

pytestmark = pytest.mark.unit


def _quantized(n: int, k: int, gs: int = 64, dtype: mx.Dtype = mx.bfloat16) -> Any:
    return mx.quantize((mx.random.normal((n, k)) * k ** -0.5).astype(dtype), group_size=gs, bits=4)


@pytest.mark.parametrize("rows, k, gs, bits, mode, dtype, why", [
    (1, 128, 64, 4, "affine", mx.bfloat16, "one row"),
    (33, 128, 64, 4, "affine", mx.bfloat16, "33 rows"),
    (4, 128, 16, 4, "affine", mx.bfloat16, "group 16"),
    (4, 128, 64, 8, "affine", mx.bfloat16, "8 bits"),
    (4, 128, 64, 4, "mxfp4", mx.bfloat16, "another mode"),
    (4, 128, 64, 4, "affine", mx.float32, "float32"),
])
def test_the_kernel_declines_what_it_does_not_take(rows: int, k: int, gs: int, bits: int, mode: str,
                                                     dtype: mx.Dtype, why: str) -> None:
    w, s, b = _quantized(64, k, gs if gs >= 32 else 32, dtype)
    x = mx.zeros((rows, k), dtype)
    assert cuda_qmatmul.plan(x, w, s, b, gs, bits, mode) is None, why
    if (bits, mode) == (4, "affine"):
        with pytest.raises(ValueError, match="2..32 rows"):
            cuda_qmatmul.qmm(x, w, s, b, gs)


def test_mismatched_arrays_are_declined() -> None:
    w, s, b = _quantized(64, 128)
    x = mx.zeros((4, 128), mx.bfloat16)
    assert cuda_qmatmul.plan(x, w, s, None, 64, 4) is None  # no biases
    assert cuda_qmatmul.plan(x, w, s.astype(mx.float16), b, 64, 4) is None  # scales in another dtype
    assert cuda_qmatmul.plan(mx.zeros((4, 256), mx.bfloat16), w, s, b, 64, 4) is None  # K mismatch
    assert cuda_qmatmul.plan(x, w, s, b, 32, 4) is None  # scales for another group size
    assert cuda_qmatmul.plan(mx.zeros((4, 128), mx.uint32), w, s, b, 64, 4) is None  # x not a float


def test_reference_is_mlx_quantized_matmul() -> None:
    mx.random.seed(3)
    w, s, b = _quantized(48, 128, 32, mx.float16)
    x = mx.random.normal((2, 5, 128)).astype(mx.float16)
    ref = cuda_qmatmul.reference(x, w, s, b, 32)
    mlx = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
    assert ref.shape == (2, 5, 48) and ref.dtype == mx.float16
    assert mx.allclose(ref.astype(mx.float32), mlx.astype(mx.float32), atol=2e-2, rtol=2e-2).item()
