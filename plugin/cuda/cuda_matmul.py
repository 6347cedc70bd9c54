"""Verify-width projections on MLX-CUDA: y = x @ w.T for 2..32 rows, one kernel launch, no per-call planning.

    y = mm(x, w)   # x [..., K] with 2..32 rows in all, w [N, K] (an nn.Linear weight) -> [..., N]

Why a kernel: MLX-CUDA 0.32 multiplies one row with its own gemv kernel but sends 2 rows and more to
cuBLASLt, building a plan and querying its heuristic on the host for every call
(mlx/backend/cuda/gemms/cublas_gemm.cpp). A 16-position forward of an 8B llama makes 225 such calls:
measured on the H200 (bench/results/kernels/h200-host-split*.json) they take ~6.5 ms of host time
against ~2.4 ms for the one-row calls, and a speculative round waits for that host time (its next
step depends on this round's outcome, so nothing hides it). MLX's own tiled kernel (``gather_mm``)
launches cheaply but is slow on the device (the 16-position forward 20 ms against 12.6).

The kernel reads each weight once for all rows: a warp owns 8*G output columns and a slice of K,
loads 16 bytes of a weight row per lane (coalesced, not kept in L1) and the rows' matching 16 bytes
of x, and multiplies them on the tensor cores (mma.sync m16n8k16, f32 accumulation; rows padded to
16 or 32). A lane's 8 consecutive k feed two mma steps in a permuted k order, the same for x and w,
so the dot products are unchanged and no shuffle is needed. The block's S warps split K; their
partial sums meet in shared memory. Compiled once per (dtype, row tiles, G, S, U) by NVRTC; shapes are
runtime values. Only mlx.core is imported; ``available()`` is False on CPU and Metal.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .probe import available
from .cuda_attention_src import MMA16816, compact, dtype_consts

MAX_ROWS = 32
DTYPES = (mx.bfloat16, mx.float16)

HEADER = r"""
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
""" + MMA16816

# grid (blocks * S * 32): block b owns columns [8*G*b, 8*G*(b+1)); S warps split K in 32-wide steps (warp
# w takes steps w, w + S, ..., loading U of them before their mma). Lane (g = lane / 4, t = lane % 4)
# loads 16 bytes at k = 32 s + 8 t of weight rows n0 + 8 j + g and of x rows 16 i + g, 16 i + g + 8. mma fragments (PTX m16n8k16): a0 = (row g,
# k 2t..2t+1), a1 = (row g+8, same k), a2/a3 = (k 2t+8..2t+9); b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..);
# c = (row g, cols 2t..2t+1), (row g+8, ...). Logical k (2t, 2t+1, 2t+8, 2t+9) are physical 8t + 0..3 in the
# first step and 8t + 4..7 in the second: a bijection of the 32 k, applied to x and w alike.
SETUP = r"""
  constexpr int NB = 8 * G;
  constexpr int P = NB + 1;  // shared row pitch in floats
  long long nrows = 1;
  for (int d = 0; d < x_ndim - 1; ++d) nrows *= x_shape[d];
  const int M = (int)nrows, K8 = x_shape[x_ndim - 1] / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  SELECT_WEIGHT
  const int n0 = blk * NB;
  const int steps = (K8 + 3) / 4;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv = reinterpret_cast<const uint4*>(wp);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float c[MT][G][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < G; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
"""
# A chunk's loads: U steps from step START into WB [U][G] (weights) and XA [U][MT][2] (x), zeros past the edges
LOADS = r"""
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kc = (START + u * S) * 4 + t;
      const bool kin = kc < K8;
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int n = n0 + j * 8 + g;
        WB[u][j] = (kin && n < N) ? ld_stream(wv + (long long)n * K8 + kc) : zero;
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = i * 16 + h * 8 + g;
          XA[u][i][h] = (kin && r < M) ? xv[(long long)r * K8 + kc] : zero;
        }
    }
"""
# A chunk's products: c += xa wb over its U steps
MMAS = r"""
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const unsigned a1[4] = {xa[u][i][0].x, xa[u][i][1].x, xa[u][i][0].y, xa[u][i][1].y};
        const unsigned a2[4] = {xa[u][i][0].z, xa[u][i][1].z, xa[u][i][0].w, xa[u][i][1].w};
#pragma unroll
        for (int j = 0; j < G; ++j) {
          mma16816<BF>(c[i][j], a1, wb[u][j].x, wb[u][j].y);
          mma16816<BF>(c[i][j], a2, wb[u][j].z, wb[u][j].w);
        }
      }
"""


def _loads(start: str, wb: str, xa: str) -> str:
    return LOADS.replace("START", start).replace("WB", wb).replace("XA", xa)


LOOP = r"""
  // U steps of a warp per chunk: all their loads in flight before the first mma
  for (int s0 = warp; s0 < steps; s0 += S * U) {
    uint4 wb[U][G];
    uint4 xa[U][MT][2];
""" + _loads("s0", "wb", "xa") + MMAS + "  }\n"
# PIPE (shape (G, S, U, 1)): each chunk's loads issued before the previous chunk's mma, so a warp always has loads
# in flight; the same products summed in the same order (the same bits). A source of its own: MLX copies and
# hashes a kernel's source at every launch, and the plan's stays as it is.
PIPE_LOOP = r"""
  uint4 wb[U][G];
  uint4 xa[U][MT][2];
""" + _loads("warp", "wb", "xa") + r"""
  for (int s0 = warp; s0 < steps; s0 += S * U) {
    uint4 wn[U][G];
    uint4 xn[U][MT][2];
""" + _loads("s0 + S * U", "wn", "xn") + MMAS + r"""
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < G; ++j) wb[u][j] = wn[u][j];
#pragma unroll
      for (int i = 0; i < MT; ++i) xa[u][i][0] = xn[u][i][0], xa[u][i][1] = xn[u][i][1];
    }
  }
"""
MAIN = SETUP + LOOP
PIPE_MAIN = SETUP + PIPE_LOOP
# the S warps' partial sums [S][MT*16][NB] meet in shared memory; row r, column n0 + col goes to yp[r * N + n]
# (shared with plugin/cuda/cuda_qmatmul.py)
REDUCE = r"""
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* red = reinterpret_cast<float*>(smem_raw);  // [S][MT * 16][P]
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < G; ++j) {
      float* r0 = red + (warp * MT * 16 + i * 16 + g) * P + j * 8 + t * 2;
      r0[0] = c[i][j][0];
      r0[1] = c[i][j][1];
      r0[8 * P] = c[i][j][2];
      r0[8 * P + 1] = c[i][j][3];
    }
  __syncthreads();
  const int rows = M < MT * 16 ? M : MT * 16;
  for (int e = threadIdx.x; e < rows * NB; e += S * 32) {
    const int r = e / NB, col = e - r * NB;
    float acc = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < S; ++w2) acc += red[(w2 * MT * 16 + r) * P + col];
    const int n = n0 + col;
    if (n < N) yp[(long long)r * N + n] = static_cast<T>(acc);
  }
"""
MAIN += REDUCE
PIPE_MAIN += REDUCE


_KERNELS: Dict[tuple, object] = {}
_LAUNCH: Dict[tuple, object] = {}


def shared_bytes(row_tiles: int, groups: int, splits: int) -> int:
    return splits * row_tiles * 16 * (8 * groups + 1) * 4


# (G, S, U[, PIPE]): column groups of 8 per warp, warps per block (K splits), steps a warp loads at once, and
# whether a chunk's loads are issued before the previous chunk's mma. S is the same in every shape, and G, U
# and PIPE leave each warp's k order as it is, so every shape gives the same bits (a fused launch's products
# are those of each weight's own launch).
# Up to 16 rows (the default block), each launch timed alone by Nsight Compute with the weight out of the L2
# (bench/forward_kernels.py --shapes, kernels/h200-forward-kernels-shapes.json), us: the deep ones need loads
# always in flight (down 4096 x 14336: 39 PIPED against 50 for the previous plan, 46 the best unpipelined shape;
# the DFlash fc 4096 x 20480: 54 against 68 and 64), and so do the narrow ones (q/o 16 against 18; k/v 11
# against 13, 8 only with 32 warps splitting K, which the fused q/k/v launch would not share); the wide ones
# over K <= 8192 do not (gate/up 39-40 WIDE against 42 PIPED).
# Over 17-32 rows (two row tiles: twice the registers), bench/results/kernels/h200-matmul-check-sweep2.json
# (µs per chain call): one group per warp for the 4096-wide projections, two groups and two steps in flight
# for the wide and the deep ones.
NARROW = (1, 8, 1)
WIDE = (2, 8, 2)
PIPED = (2, 8, 2, 1)
assert NARROW[1] == WIDE[1] == PIPED[1], "one K split: a fused launch's products must be the bits of each weight's own"


def shape_for(columns: int, K: int, rows: int = 16) -> Tuple[int, ...]:
    """(G, S, U[, PIPE]) for one launch of ``columns`` output columns in all (every weight together) over K and
    ``rows`` rows."""
    if rows <= 16:
        return WIDE if columns > 8192 and K <= 8192 else PIPED
    return NARROW if columns <= 8192 and K <= 8192 else WIDE


MAX_WEIGHTS = 10  # weights one launch multiplies the same x by (siblings: q/k/v, gate/up; a DFlash drafter's K/V of 5 layers)


def _select(weights: int) -> str:
    """Source picking block blk's weight: the weights' column blocks follow one another in the grid, each
    block doing exactly the work it does in a launch of its weight alone (so the products are the same bits)."""
    code = "int blk = blockIdx.x; const T* wp; T* yp; int N; int nb;\n"
    for i in range(weights - 1):
        code += (f"nb = (w{i}_shape[0] + NB - 1) / NB;\n"
                 f"if (blk < nb) {{ wp = w{i}; yp = y{i}; N = w{i}_shape[0]; }} else {{ blk -= nb;\n")
    last = weights - 1
    return code + f"wp = w{last}; yp = y{last}; N = w{last}_shape[0];" + "}" * (weights - 1) + "\n"


def _kernel(dtype: mx.Dtype, row_tiles: int, groups: int, splits: int, unroll: int, weights: int = 1,
            pipe: int = 0) -> object:
    # Constants in the source, not template arguments: a template list costs every launch its conversion
    key = (dtype, row_tiles, groups, splits, unroll, weights, pipe)
    if key not in _KERNELS:  # NVRTC compiles each at its first launch; MLX caches the module
        bf = dtype == mx.bfloat16
        consts = (dtype_consts(bf) + f"constexpr int MT = {row_tiles}, G = {groups}, S = {splits}, U = {unroll};\n")
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"spec_mm_{'bf' if bf else 'f'}{row_tiles}_{groups}_{splits}_{unroll}{'p' if pipe else ''}_w{weights}",
            input_names=["x"] + [f"w{i}" for i in range(weights)], output_names=[f"y{i}" for i in range(weights)],
            source=consts + compact(PIPE_MAIN if pipe else MAIN).replace("SELECT_WEIGHT", _select(weights)),
            header=compact(HEADER),
            shared_memory=shared_bytes(row_tiles, groups, splits))
    return _KERNELS[key]


def supports(x: mx.array, w: mx.array) -> bool:
    """Whether ``mm`` takes this call: 2..32 rows, K a multiple of 8, x and w of one 16-bit float dtype."""
    return plan(x, w) is not None


def plan(x: mx.array, w: mx.array) -> Optional[Tuple[object, dict]]:
    """(kernel, its keyword arguments) for x @ w.T, made once per (shapes, dtype); None where ``mm``
    does not take the call. ``mm`` and the projection dispatcher (plugin/cuda/projections.py) launch it
    (``kernel(inputs=[x, w], **args)``)."""
    key = (x.shape, w.shape, x.dtype, w.dtype)
    got = _LAUNCH.get(key)
    if got is None:
        got = _LAUNCH[key] = _plan(x.shape, (w.shape,), x.dtype, (w.dtype,)) or False
    return got or None


def plan_many(x: mx.array, ws: Sequence[mx.array]) -> Optional[Tuple[object, dict]]:
    """``plan`` for 1..MAX_WEIGHTS weights of one K multiplying the same x in one launch
    (``kernel(inputs=[x, *ws], **args)`` gives one output per weight, each the bits ``mm`` gives)."""
    key = (x.shape, x.dtype) + tuple((w.shape, w.dtype) for w in ws)
    got = _LAUNCH.get(key)
    if got is None:
        got = _LAUNCH[key] = _plan(x.shape, tuple(w.shape for w in ws), x.dtype, tuple(w.dtype for w in ws)) or False
    return got or None


def _plan(xs: Tuple[int, ...], wss: Tuple[Tuple[int, ...], ...], dtype: mx.Dtype, wdtypes: Tuple[mx.Dtype, ...],
          shape: Optional[Tuple[int, ...]] = None) -> Optional[Tuple[object, dict]]:
    if not xs or dtype not in DTYPES or not 1 <= len(wss) <= MAX_WEIGHTS or \
            any(len(ws) != 2 or ws[1] != xs[-1] for ws in wss) or any(d != dtype for d in wdtypes):
        return None
    K = xs[-1]
    M = 1
    for d in xs[:-1]:
        M *= d
    if not 2 <= M <= MAX_ROWS or K % 8:
        return None
    mt = 1 if M <= 16 else 2
    groups, splits, unroll, *pipe = shape or shape_for(sum(ws[0] for ws in wss), K, M)
    blocks = sum(-(-ws[0] // (8 * groups)) for ws in wss)
    return _kernel(dtype, mt, groups, splits, unroll, len(wss), pipe[0] if pipe else 0), dict(
        grid=(blocks * splits * 32, 1, 1), threadgroup=(splits * 32, 1, 1),
        output_shapes=[(*xs[:-1], ws[0]) for ws in wss], output_dtypes=[dtype] * len(wss))


def mm(x: mx.array, w: mx.array, shape: Optional[Tuple[int, ...]] = None) -> mx.array:
    """x [..., K] @ w[N, K].T -> [..., N] in x's dtype (f32 accumulation); see ``supports``.
    ``shape``: (G, S, U) or (G, S, U, PIPE) instead of ``shape_for``'s (measurements; PIPE 1: the next chunk's
    loads issued before this chunk's mma, the same bits)."""
    return mm_many(x, [w], shape)[0]


def mm_many(x: mx.array, ws: Sequence[mx.array], shape: Optional[Tuple[int, ...]] = None) -> List[mx.array]:
    """[x @ w.T for w in ws] in one launch (1..MAX_WEIGHTS weights [N_i, K]); each equals ``mm(x, w)`` bit for bit."""
    launch = plan_many(x, ws) if shape is None else \
        _plan(x.shape, tuple(w.shape for w in ws), x.dtype, tuple(w.dtype for w in ws), shape)
    if launch is None:
        got = ", ".join(f"{tuple(w.shape)} {w.dtype}" for w in ws)
        raise ValueError(f"mm: expected x [..., K] with 2..{MAX_ROWS} rows and 1..{MAX_WEIGHTS} weights [N, K], all "
                         f"bfloat16 or all float16 with K a multiple of 8; got x {tuple(x.shape)} {x.dtype}, w {got}")
    kernel, args = launch
    return kernel(inputs=[x, *ws], **args)


def reference(x: mx.array, w: mx.array) -> mx.array:
    """``mm`` in float32 with MLX's matmul (any device), rounded to x's dtype."""
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)


__all__: List[str] = ["available", "mm", "mm_many", "plan", "plan_many", "reference", "supports", "shape_for", "MAX_ROWS", "MAX_WEIGHTS", "NARROW", "WIDE",
                     "PIPED"]
