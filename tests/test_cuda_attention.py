"""The CUDA attention module's CPU-side parts: its float32 reference and mask semantics against MLX's SDPA,
the key split arithmetic the kernel repeats, input validation, and that it stays off without CUDA.
The kernel itself runs on the GPU only (bench/gpu_attention_check.py)."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlx_speculative.plugin.cuda import cuda_attention as ca

pytestmark = pytest.mark.unit


def _qkv(B: int, Hq: int, Hkv: int, L: int, S: int, D: int, seed: int = 0):
    mx.random.seed(seed)
    return (mx.random.normal((B, Hq, L, D)), mx.random.normal((B, Hkv, S, D)), mx.random.normal((B, Hkv, S, D)))


def test_off_without_cuda() -> None:
    assert not ca.available()


@pytest.mark.parametrize("L,S,G", [(5, 37, 4), (16, 16, 1), (2, 300, 8)])
def test_reference_is_causal_sdpa_at_the_end_of_the_keys(L: int, S: int, G: int) -> None:
    q, k, v = _qkv(1, 8, 8 // G, L, S, 64)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = ca.reference(q, k, v, 0.125, S, S - L)
    assert mx.abs(got - want).max().item() < 1e-5


def test_reference_never_reads_garbage_or_padding() -> None:
    B, L, S_alloc = 3, 4, 96
    q, k, v = _qkv(B, 4, 2, L, S_alloc, 64, seed=1)
    starts, lens = mx.array([0, 5, 20]), mx.array([60, 96, 41])
    j = mx.arange(S_alloc)
    keep = (j[None] >= starts[:, None]) & (j[None] < lens[:, None])  # [B, S]
    dirty_k = mx.where(keep[:, None, :, None], k, math.nan)
    dirty_v = mx.where(keep[:, None, :, None], v, math.inf)
    offset = lens - L
    seen = keep[:, None, :] & (j[None, None] <= offset[:, None, None] + mx.arange(L)[None, :, None])  # [B, L, S]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=seen[:, None])
    got = ca.reference(q, dirty_k, dirty_v, 0.125, lens, offset, starts)
    assert mx.isfinite(got).all().item()
    assert mx.abs(got - want).max().item() < 1e-5


def test_reference_non_causal_and_empty_rows() -> None:
    q, k, v = _qkv(1, 4, 4, 16, 10, 64, seed=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    assert mx.abs(ca.reference(q, k, v, 0.125, 10, 10) - want).max().item() < 1e-5
    # queries before the first key see nothing: zeros, not NaN
    got = ca.reference(q, k, v, 0.125, 10, -8)
    assert mx.abs(got[:, :, :8]).max().item() == 0.0
    assert mx.abs(got[:, :, 8:]).min().item() > 0.0


def test_split_arithmetic_matches_the_kernel() -> None:
    for D in ca.HEAD_DIMS:
        for variant in ca.VARIANTS:
            kb = ca.tile_keys(D, variant)
            assert ca.shared_bytes(D, variant) <= 227 * 1024 and kb % 16 == 0
            for keys in (1, 31, 64, 65, 1000, 4096, 8191, 16384, 20000, 100000):
                for units in (1, 3, 8, 32, 64, 1000):
                    for target in (None, 1, 66, 528):
                        splits = ca.num_splits(keys, units, D, target, variant)
                        ntiles = -(-keys // kb)
                        per = -(-ntiles // splits)  # as the kernel computes it from its grid
                        assert splits * per >= ntiles and (splits - 1) * per < ntiles, (D, variant, keys, units, target)
    assert ca.num_splits(16384, 8, 128) > 16  # long keys spread over the SMs
    assert ca.num_splits(16384, 8, 128, target_blocks=1) == 1


def test_attention_params_layout() -> None:
    p = ca.attention_params(2, 40, -3, key_start=5)  # ints: carried by a broadcast's shape, no memory
    assert p.ndim == 4 and ca.decode_params(p) == [[5, 40, -3]]
    p = ca.attention_params(2, mx.array([40, 30]), mx.array(24), key_start=mx.array([0, 3]))
    assert p.dtype == mx.int32 and ca.decode_params(p) == [[0, 40, 24], [3, 30, 24]]
    with pytest.raises(ValueError, match="key_len -1"):
        ca.attention_params(1, -1, 0)


@pytest.mark.parametrize("shape,dtype,field", [
    ((1, 8, 4, 96), mx.bfloat16, "head dim 96"),
    ((1, 8, 4, 64), mx.float32, "float32"),
    ((1, 6, 4, 64), mx.bfloat16, "Hq a multiple of Hkv"),
])
def test_sdpa_rejects_bad_input_with_one_line(shape, dtype, field) -> None:
    q = mx.zeros(shape, dtype=dtype)
    k = mx.zeros((1, 4, 32, shape[-1]), dtype=dtype)
    with pytest.raises(ValueError, match=field):
        ca.sdpa(q, k, k, 0.1, 32, 28)
