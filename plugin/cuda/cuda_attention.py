"""Short-query attention on MLX-CUDA: flash-decoding on the tensor cores, for forwards of 2..32 queries.

    out = sdpa(q, k, v, scale, key_len, offset)   # q [B, Hq, L, D], k/v [B, Hkv, S_alloc, D] -> [B, Hq, L, D]

Query i sits at position ``offset + i`` and sees keys j with ``key_start <= j < key_len`` and
``j <= offset + i`` (``offset >= key_len`` gives non-causal attention, as a drafter's block uses).
``key_len``, ``offset`` and ``key_start`` are ints or int arrays (shape [] or [B]); keys past key_len
(a KV buffer allocated in steps) and before key_start (left padding) are never read into the softmax.

Why a kernel: MLX runs 2..32-query attention through few thread blocks that each walk all the keys, so
at 4k-16k keys it is latency-bound. Here the keys are split across thread blocks (flash-decoding); each
block loads 64-key K/V tiles (32 at head dim 256) through shared memory with cp.async (two stages), and
its 4 warps (16 query rows each: all query heads of one KV head times the L queries) multiply them on the
tensor cores (mma.sync m16n8k16, f32 accumulation, online softmax in f32). A second small kernel
merges the partial softmaxes (a warp per row); with one split the first kernel writes the output itself.
Measured on the H200 (docs/benchmarks.md, bench/results/kernels/): faster than SDPA "causal" from ~4k keys
(2.3x in chained calls at 16k), slower at 512 keys, where launch costs dominate.

Compiled once per (head dim, dtype, variant) by NVRTC (MLX caches the module; the three are constants
in the source): shapes, strides, key length, offset and padding are runtime arguments, so new key
lengths compile nothing. The CUDA sources live in cuda_attention_src.py. Only mlx.core is imported;
nothing CUDA-specific runs at import time, and ``available()`` is False on CPU and Metal. plugin/cuda/attention.py
decides per call whether decoding uses it.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import mlx.core as mx

from .probe import available  # where the kernel can run
from . import cuda_attention_src as src

IntOrArray = Union[int, mx.array]

HEAD_DIMS = (64, 128, 256)
WARPS = 4  # per thread block; each warp owns 16 query rows
NUM_SMS = 132  # H200; only sizes the key split
_LOG2E = 1.4426950408889634
OFFSET_BIAS = 1 << 20  # int params travel as shape entries, which are positive: offsets down to 1 - OFFSET_BIAS


class Variant(NamedTuple):
    """Kernel shape choices; each (head dim, dtype, variant) compiles once."""

    tile: int  # keys per K/V tile; 0: 64, or 32 at head dim 256 (registers)
    stages: int  # shared-memory stages: stages - 1 tiles in flight while one is computed
    combine: str  # "warp": a warp per row, splits in parallel; "thread": a thread walks the splits


VARIANTS: Dict[str, Variant] = {
    "base": Variant(0, 2, "warp"),
    "base_thread_combine": Variant(0, 2, "thread"),
    "stages3": Variant(0, 3, "warp"),
    "tile32": Variant(32, 2, "warp"),
    "tile32_stages3": Variant(32, 3, "warp"),
}
DEFAULT_VARIANT = "base"


def tile_keys(head_dim: int, variant: str = DEFAULT_VARIANT) -> int:
    return VARIANTS[variant].tile or (32 if head_dim > 128 else 64)


def shared_bytes(head_dim: int, variant: str = DEFAULT_VARIANT) -> int:
    # K and V in `stages` buffers, and the block's 64 query rows; rows padded by 16 bytes
    return (2 * VARIANTS[variant].stages * tile_keys(head_dim, variant) + WARPS * 16) * (head_dim + 8) * 2


def blocks_per_sm(head_dim: int, variant: str = DEFAULT_VARIANT) -> int:
    by_smem = 232448 // (shared_bytes(head_dim, variant) + 1024)  # 227 KB a block, 228 KB an SM
    by_regs = 2 if head_dim > 128 else 3  # ~242 / ~133 registers a thread (ptxas), 128 threads a block
    return max(1, min(by_smem, by_regs))


_KERNELS: Dict[Tuple[mx.Dtype, int, str], Tuple[object, object]] = {}
_SCALES: Dict[float, mx.array] = {}
_LAUNCH: Dict[tuple, tuple] = {}
_ZERO: List[mx.array] = []


def _kernels(dtype: mx.Dtype, head_dim: int, variant: str) -> Tuple[object, object]:
    # Constants in the (compacted) source, not template arguments: MLX converts a template list and copies
    # and hashes the source at every launch, ~40 launches a forward
    key = (dtype, head_dim, variant)
    if key not in _KERNELS:  # NVRTC compiles each at its first launch, then MLX caches the module
        bf = dtype == mx.bfloat16
        vt = VARIANTS[variant]
        warp = vt.combine == "warp"
        typ = src.dtype_consts(bf)
        consts = typ + f"constexpr int D = {head_dim}, KB = {tile_keys(head_dim, variant)}, ST = {vt.stages};\n"
        tag = f"{'bf' if bf else 'f'}{head_dim}"
        main = mx.fast.cuda_kernel(
            name=f"spec_attn_split_{tag}_{variant}", input_names=["q", "k", "v", "prm", "scl"],
            output_names=["opart", "ml", "out"], source=consts + src.compact(src.MAIN),
            header=src.compact(src.HEADER), ensure_row_contiguous=False,
            shared_memory=shared_bytes(head_dim, variant))
        combine = mx.fast.cuda_kernel(
            name=f"spec_attn_combine_{'warp' if warp else 'thread'}_{tag}", input_names=["opart", "ml"],
            output_names=["out"], header=src.compact(src.HEADER),
            source=typ + f"constexpr int D = {head_dim};\n" + src.compact(src.COMBINE_WARP if warp else src.COMBINE_THREAD))
        _KERNELS[key] = (main, combine)
    return _KERNELS[key]


def _per_batch(x: IntOrArray, batch: int) -> mx.array:
    # [B] int32 from an int or an int array of shape [] or [B]
    return mx.broadcast_to((x if isinstance(x, mx.array) else mx.array(x)).astype(mx.int32), (batch,))


def attention_params(batch: int, key_len: IntOrArray, offset: IntOrArray, key_start: IntOrArray = 0) -> mx.array:
    """The kernel's runtime mask arguments: (key_start, key_len, offset) per batch entry.

    Ints travel in the shape (1, key_start + 1, key_len + 1, offset + OFFSET_BIAS) of a broadcast scalar:
    no memory, so nothing is written by the host per call (a small host array the GPU reads costs a
    managed-memory migration, 60-200 us a call on the H200). Arrays give an int32 [B, 3] built on the device.
    """
    if all(isinstance(x, int) for x in (key_start, key_len, offset)):
        if key_start < 0 or key_len < 0 or offset <= -OFFSET_BIAS:
            raise ValueError(f"sdpa: key_start {key_start}, key_len {key_len}, offset {offset}; allowed: key_start >= 0, "
                             f"key_len >= 0, offset > {-OFFSET_BIAS}")
        if not _ZERO:
            _ZERO.append(mx.array(0, dtype=mx.int32))
        return mx.broadcast_to(_ZERO[0], (1, key_start + 1, key_len + 1, offset + OFFSET_BIAS))
    return mx.stack([_per_batch(x, batch) for x in (key_start, key_len, offset)], axis=-1)


def decode_params(prm: mx.array) -> List[List[int]]:
    """(key_start, key_len, offset) rows of ``attention_params``' result (for tests and logs)."""
    if prm.ndim == 4:
        return [[prm.shape[1] - 1, prm.shape[2] - 1, prm.shape[3] - OFFSET_BIAS]]
    return prm.tolist()


def num_splits(keys: int, units: int, head_dim: int, target_blocks: Optional[int] = None,
               variant: str = DEFAULT_VARIANT) -> int:
    """Key splits for ``units`` (batch x KV heads x row chunks) blocks' worth of work over ``keys`` keys:
    about one wave of resident blocks over the SMs."""
    ntiles = -(-keys // tile_keys(head_dim, variant))
    target = target_blocks or NUM_SMS * blocks_per_sm(head_dim, variant)
    want = max(1, -(-target // units))
    per = -(-ntiles // want)
    return max(1, -(-ntiles // per))  # the kernel recomputes per = ceil(ntiles / splits): the same value


def _check(q: mx.array, k: mx.array, v: mx.array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"sdpa: expected q [B, Hq, L, D] and k, v [B, Hkv, S, D] alike; got q {q.shape}, k {k.shape}, v {v.shape}")
    B, Hq, L, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1] != 0:
        raise ValueError(f"sdpa: k/v {k.shape} do not fit q {q.shape} (same B and D, Hq a multiple of Hkv)")
    if D not in HEAD_DIMS:
        raise ValueError(f"sdpa: head dim {D} not supported; allowed: {HEAD_DIMS}")
    if q.dtype not in (mx.bfloat16, mx.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"sdpa: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}; allowed: all bfloat16 or all float16")


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, key_len: IntOrArray, offset: IntOrArray,
         key_start: IntOrArray = 0, *, params: Optional[mx.array] = None,
         target_blocks: Optional[int] = None, variant: str = DEFAULT_VARIANT) -> mx.array:
    """Attention of q [B, Hq, L, D] over k, v [B, Hkv, S_alloc, D] (GQA), masked from key_len/offset/key_start.

    ``params`` (from ``attention_params``) can be built once per forward and shared by its layers.
    """
    _check(q, k, v)
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if all(isinstance(x, int) for x in (key_len, offset)):
        S = max(0, min(S, key_len, offset + L))  # no launch reaches keys no query sees
        k, v = k[:, :, :S], v[:, :, :S]  # views: strides travel to the kernel, nothing is copied
    if S == 0:
        return mx.zeros(q.shape, dtype=q.dtype)
    prm = params if params is not None else attention_params(B, key_len, offset, key_start)
    if scale not in _SCALES:  # computed on the device once: the kernel reads device memory, not managed memory
        _SCALES[scale] = mx.array([scale * _LOG2E], dtype=mx.float32) + 0.0
    key = (B, Hq, Hkv, L, D, S, q.dtype, target_blocks, variant)
    if key not in _LAUNCH:
        _LAUNCH[key] = _launch(B, Hq, Hkv, L, D, S, q.dtype, target_blocks, variant)
    many, main_args, combine_args = _LAUNCH[key]
    main, combine = _kernels(q.dtype, D, variant)
    opart, ml, out = main(inputs=[q, k, v, prm, _SCALES[scale]], **main_args)
    if many:
        out = combine(inputs=[opart, ml], **combine_args)[0]
    return out.swapaxes(1, 2)  # [B, Hq, L, D] view of [B, L, Hq, D]: the model's transpose back is free


def _launch(B: int, Hq: int, Hkv: int, L: int, D: int, S: int, dtype: mx.Dtype, target_blocks: Optional[int],
            variant: str) -> tuple:
    chunks = -(-(Hq // Hkv) * L // (WARPS * 16))
    splits = num_splits(S, B * Hkv * chunks, D, target_blocks, variant)
    many = splits > 1  # one split: the first kernel writes the output, no partials
    warp = VARIANTS[variant].combine == "warp"
    main_args = dict(
        grid=(splits * WARPS * 32, chunks, B * Hkv), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(splits, B, Hq, L, D) if many else (1,), (splits, B, Hq, L, 2) if many else (1,),
                       (1,) if many else (B, L, Hq, D)],
        output_dtypes=[mx.float32, mx.float32, dtype])
    combine_args = dict(grid=(B * Hq * L * (32 if warp else D // 4), 1, 1),
                        threadgroup=(128, 1, 1),
                        output_shapes=[(B, L, Hq, D)], output_dtypes=[dtype])
    return many, main_args, combine_args


def reference(q: mx.array, k: mx.array, v: mx.array, scale: float, key_len: IntOrArray, offset: IntOrArray,
              key_start: IntOrArray = 0, dtype: Optional[mx.Dtype] = None) -> mx.array:
    """Pure-MLX float32 version of ``sdpa`` (any device): the same mask, rows seeing no key give 0."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    j = mx.arange(S)
    lo, hi, off = (_per_batch(x, B)[:, None] for x in (key_start, key_len, offset))  # [B, 1]
    keep = (j >= lo) & (j < hi)  # [B, S]
    seen = keep[:, None, :] & (j[None, None, :] <= off[:, :, None] + mx.arange(L)[None, :, None])  # [B, L, S]
    kf = mx.where(keep[:, None, :, None], k.astype(mx.float32), 0.0)[:, :, None]  # garbage never reaches a sum
    vf = mx.where(keep[:, None, :, None], v.astype(mx.float32), 0.0)[:, :, None]
    qf = q.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, L, D)
    s = (qf * scale) @ kf.swapaxes(-1, -2)  # [B, Hkv, G, L, S]
    s = mx.where(seen[:, None, None], s, -math.inf)
    top = s.max(axis=-1, keepdims=True)
    p = mx.exp(s - mx.where(top == -math.inf, 0.0, top))
    den = p.sum(axis=-1, keepdims=True)
    o = (p @ vf) / mx.where(den > 0, den, 1.0)
    return o.reshape(B, Hq, L, D).astype(dtype or q.dtype)


__all__: List[str] = ["available", "sdpa", "reference", "attention_params", "decode_params", "num_splits", "HEAD_DIMS",
                       "VARIANTS", "DEFAULT_VARIANT"]
