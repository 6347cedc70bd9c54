"""Verify-width 4-bit projections on MLX-CUDA: y = x @ dequantize(w).T for 2..32 rows, one kernel launch.

    y = qmm(x, w, scales, biases, group_size)   # an nn.QuantizedLinear's arrays (affine, 4 bits) -> [..., N]

Why a kernel: MLX-CUDA 0.32 multiplies up to 7 rows of a 4-bit weight with ``qmv`` once per row and 8
rows or more with ``qmm_sm80`` (its sm90 kernel declines group sizes under K). In a forward's order (each
call waiting for the one before) 16 rows of an 8B llama's matmuls cost 14.3 ms against 5.7 ms for one row
(bench/results/kernels/h200-quantized-matmul-cost-skeleton.json): a 4-bit verify forward pays ~8.6 ms
over a one-token step, where the bf16 target pays ~1.
This kernel costs 5.6 ms at 16 rows in that skeleton (4.3 at 2) and passes bench/gpu_qmatmul_check.py on
the H200 (bench/results/kernels/h200-qmatmul-check.json).

The kernel is plugin/cuda/cuda_matmul.py's with 4-bit weights: a warp owns 8*G output columns and a slice of
K; per 128-wide step a lane loads 16 bytes (32 codes) of a weight row, coalesced (the 4 lanes of a row
read 64 consecutive bytes), and the rows' matching 64 bytes of x. It dequantizes in registers (code
pairs to 16-bit floats exactly by the exponent trick, then ``scale * q + bias`` rounded once, as MLX's
dequantize does) and multiplies on the tensor cores (mma.sync m16n8k16, f32 accumulation; rows padded to
16 or 32). Codes come in pairs (e_i, e_i+4) of a 32-bit word, so x is paired the same way (a byte
permute): the products of the chunk are unchanged. Compiled once per (dtype, row tiles, G, S, group
size) by NVRTC; shapes are runtime values. Only mlx.core is imported; ``available()`` is False on CPU and
Metal.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from .probe import available
from .cuda_attention_src import compact, dtype_consts
from .cuda_matmul import DTYPES, HEADER, MAX_ROWS, REDUCE, shared_bytes

BITS = 4
GROUP_SIZES = (32, 64, 128)  # a lane's 32 codes of a step lie in one group

# grid (blocks * S * 32): block b owns columns [8*G*b, 8*G*(b+1)); S warps split K in 128-wide steps (warp w
# takes steps w, w + S, ...). Lane (g = lane / 4, t = lane % 4) loads the uint4 at k = 128 s + 32 t of weight
# rows n0 + 8 j + g (32 codes: word m holds k + 8 m + e at bits 4 e) and, for chunk m, x's 8 values at
# k + 8 m of rows 16 i + g and 16 i + g + 8. Code pair i = (e_i, e_i+4) meets x pair (k_i, k_i+4): chunk m's
# first mma takes pairs 0, 1 (a0/a1 rows g/g+8, a2/a3), its second pairs 2, 3; a bijection of the chunk's 8 k.
MAIN = r"""
  T* yp = y;
  constexpr int NB = 8 * G;
  constexpr int P = NB + 1;
  long long nrows = 1;
  for (int d = 0; d < x_ndim - 1; ++d) nrows *= x_shape[d];
  const int M = (int)nrows, K = x_shape[x_ndim - 1], K8 = K / 8, K32 = K / 32, NG = K / GS;
  const int N = w_shape[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * NB;
  const int steps = (K32 + 3) / 4;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float c[MT][G][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < G; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
  for (int s0 = warp; s0 < steps; s0 += S) {
    const int kc = s0 * 4 + t;  // the lane's 32-wide chunk of K
    const bool kin = kc < K32;
    uint4 wb[G];
    T2 sc[G], bi[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int n = n0 + j * 8 + g;
      const bool ok = kin && n < N;
      wb[j] = ok ? ld_stream(wv + (long long)n * (K8 / 4) + kc) : zero;
      const long long gi = (long long)n * NG + (kc * 32) / GS;
      const T s = ok ? scales[gi] : T(0.f), b = ok ? biases[gi] : T(0.f);
      sc[j] = T2{s, s};
      bi[j] = T2{b, b};
    }
    unsigned xa[MT][2][4][4];  // [row tile][rows g / g+8][chunk m][pair]
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = i * 16 + h * 8 + g;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const uint4 v = (kin && r < M) ? xv[(long long)r * K8 + kc * 4 + m] : zero;
          xa[i][h][m][0] = __byte_perm(v.x, v.z, 0x5410);
          xa[i][h][m][1] = __byte_perm(v.x, v.z, 0x7632);
          xa[i][h][m][2] = __byte_perm(v.y, v.w, 0x5410);
          xa[i][h][m][3] = __byte_perm(v.y, v.w, 0x7632);
        }
      }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const unsigned words[4] = {wb[j].x, wb[j].y, wb[j].z, wb[j].w};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        unsigned wp[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const unsigned q = ((words[m] >> (4 * p)) & 0x000F000Fu) | MAGIC;  // (e_p, e_p+4) as MAGIC + code
          T2 v = *reinterpret_cast<const T2*>(&q);
          v = __hfma2(__hsub2(v, MAGIC2), sc[j], bi[j]);
          wp[p] = *reinterpret_cast<unsigned*>(&v);
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const unsigned a1[4] = {xa[i][0][m][0], xa[i][1][m][0], xa[i][0][m][1], xa[i][1][m][1]};
          const unsigned a2[4] = {xa[i][0][m][2], xa[i][1][m][2], xa[i][0][m][3], xa[i][1][m][3]};
          mma16816<BF>(c[i][j], a1, wp[0], wp[1]);
          mma16816<BF>(c[i][j], a2, wp[2], wp[3]);
        }
      }
    }
  }
"""


# (G, S): column groups of 8 per warp, warps per block (K splits); cuda_matmul's shape, not yet swept for 4 bits
SHAPE = (2, 8)

_KERNELS: Dict[tuple, object] = {}
_LAUNCH: Dict[tuple, object] = {}


def _consts(bf16: bool, row_tiles: int, groups: int, splits: int, group_size: int) -> str:
    # MAGIC: a 16-bit float whose low mantissa bits take a code exactly (bf16 128 + q, f16 1024 + q)
    magic = "0x43004300u" if bf16 else "0x64006400u"
    t2 = "__nv_bfloat162" if bf16 else "__half2"
    return (dtype_consts(bf16) + f"typedef {t2} T2;\nconstexpr unsigned MAGIC = {magic};\n"
            f"constexpr int MT = {row_tiles}, G = {groups}, S = {splits}, GS = {group_size};\n"
            "const unsigned magic_bits = MAGIC; const T2 MAGIC2 = *reinterpret_cast<const T2*>(&magic_bits);\n")


def _kernel(dtype: mx.Dtype, row_tiles: int, groups: int, splits: int, group_size: int) -> object:
    key = (dtype, row_tiles, groups, splits, group_size)
    if key not in _KERNELS:  # NVRTC compiles each at its first launch; MLX caches the module
        bf = dtype == mx.bfloat16
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"spec_qmm4_{'bf' if bf else 'f'}{row_tiles}_{groups}_{splits}_g{group_size}",
            input_names=["x", "w", "scales", "biases"], output_names=["y"],
            source=_consts(bf, row_tiles, groups, splits, group_size) + compact(MAIN + REDUCE), header=compact(HEADER),
            shared_memory=shared_bytes(row_tiles, groups, splits))
    return _KERNELS[key]


def plan(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int,
         mode: str = "affine", shape: Optional[Tuple[int, int]] = None) -> Optional[Tuple[object, dict]]:
    """(kernel, its keyword arguments) for ``qmm``, made once per (shapes, dtype, group size); None where
    ``qmm`` does not take the call (launch: ``kernel(inputs=[x, w, scales, biases], **args)``)."""
    key = (x.shape, w.shape, scales.shape, x.dtype, w.dtype, scales.dtype, biases is None, group_size, bits, mode, shape)
    got = _LAUNCH.get(key)
    if got is None:
        got = _LAUNCH[key] = _plan(x, w, scales, biases, group_size, bits, mode, shape) or False
    return got or None


def _plan(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int,
          mode: str, shape: Optional[Tuple[int, int]]) -> Optional[Tuple[object, dict]]:
    if mode != "affine" or bits != BITS or group_size not in GROUP_SIZES or biases is None or x.ndim < 1 or \
            x.dtype not in DTYPES or scales.dtype != x.dtype or biases.dtype != x.dtype or w.dtype != mx.uint32:
        return None
    K = x.shape[-1]
    N = w.shape[0] if w.ndim == 2 else 0
    if not N or K % 32 or K % group_size or w.shape[1] * 8 != K or \
            tuple(scales.shape) != (N, K // group_size) or tuple(biases.shape) != (N, K // group_size):
        return None
    M = x.size // K if K else 0
    if not 2 <= M <= MAX_ROWS:
        return None
    mt = 1 if M <= 16 else 2
    groups, splits = shape or SHAPE
    blocks = -(-N // (8 * groups))
    return _kernel(x.dtype, mt, groups, splits, group_size), dict(
        grid=(blocks * splits * 32, 1, 1), threadgroup=(splits * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype])


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64,
        shape: Optional[Tuple[int, int]] = None) -> mx.array:
    """x [..., K] @ dequantize(w, scales, biases).T -> [..., N] in x's dtype (f32 accumulation): 2..32 rows,
    4 bits, affine, group size 32, 64 or 128, K a multiple of 32. ``shape``: (G, S) instead of ``SHAPE``."""
    launch = plan(x, w, scales, biases, group_size, BITS, "affine", shape)
    if launch is None:
        raise ValueError(f"qmm: expected x [..., K] with 2..{MAX_ROWS} rows in bfloat16 or float16, w uint32 [N, K/8], "
                         f"scales and biases [N, K/group] in x's dtype, group size one of {GROUP_SIZES}, K a multiple "
                         f"of 32; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, group size {group_size}")
    kernel, args = launch
    return kernel(inputs=[x, w, scales, biases], **args)[0]


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64) -> mx.array:
    """``qmm`` with MLX's ops (any device): the weight dequantized (rounded to x's dtype, as the kernel
    rounds it), the product in float32, rounded to x's dtype."""
    wd = mx.dequantize(w, scales, biases, group_size=group_size, bits=BITS).astype(x.dtype)
    return (x.astype(mx.float32) @ wd.astype(mx.float32).T).astype(x.dtype)


__all__: List[str] = ["available", "qmm", "plan", "reference", "BITS", "GROUP_SIZES"]
