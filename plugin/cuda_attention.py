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
Measured on the H200 (bench/README.md, bench/results/kernels/): faster than SDPA "causal" from ~4k keys
(2.3x in chained calls at 16k), slower at 512 keys, where launch costs dominate.

Compiled once per (head dim, dtype, variant) by NVRTC (MLX caches the module): shapes, strides, key
length, offset and padding are runtime arguments, so new key lengths compile nothing. Only mlx.core is
imported; nothing CUDA-specific runs at import time, and ``available()`` is False on CPU and Metal.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import mlx.core as mx

IntOrArray = Union[int, mx.array]

HEAD_DIMS = (64, 128, 256)
WARPS = 4  # per thread block; each warp owns 16 query rows
NUM_SMS = 132  # H200; only sizes the key split
_LOG2E = 1.4426950408889634
OFFSET_BIAS = 1 << 20  # int params travel as shape entries, which are positive: offsets down to 1 - OFFSET_BIAS


def available() -> bool:
    """True where the kernel can run: MLX built with CUDA and the GPU as the default device."""
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)
    except (AttributeError, RuntimeError):
        return False


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


_HEADER = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared; ok == false writes zeros and reads nothing
__device__ __forceinline__ void cp16(unsigned dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
__device__ __forceinline__ void ldsm4(unsigned a, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(unsigned a, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// c[16x8] += a[16x16] b[16x8], f32 accumulation
template <bool BF>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  if constexpr (BF) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __half) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
"""

# grid (splits, row chunks of 64, B * Hkv); 4 warps. Inputs: q/k/v with their strides, prm: int32 [B, 3]
# (key_start, key_len, offset) or, for ints, a 4-D broadcast carrying them in its shape (see attention_params),
# scl float32 [1] (scale * log2 e). Outputs: opart f32 [splits, B, Hq, L, D]
# and ml f32 [splits, B, Hq, L, 2] (row max in log2 units, row sum) when splits > 1, else out [B, L, Hq, D].
_MAIN = r"""
  constexpr int NW = 4;
  constexpr int LDS = D + 8;  // row pitch: 16 bytes of pad put ldmatrix's 8 rows on distinct banks
  constexpr int CH = D / 8;   // 16-byte chunks per row
  constexpr int NT = D / 8;   // output n-tiles
  constexpr int SN = KB / 8;  // score n-tiles per key tile
  const float NEG_INF = -__int_as_float(0x7f800000);
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);  // [ST][KB][LDS]: ST stages, ST - 1 tiles in flight
  T* Vs = Ks + ST * KB * LDS;              // [ST][KB][LDS]
  T* Qs = Vs + ST * KB * LDS;              // [NW * 16][LDS]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int Bn = q_shape[0], Hq = q_shape[1], L = q_shape[2];
  const int Hkv = k_shape[1], S = k_shape[2];
  const int G = Hq / Hkv, M = G * L;
  const int b = blockIdx.z / Hkv, h = blockIdx.z % Hkv;
  const int split = blockIdx.x, nsplit = gridDim.x;
  const int row0 = blockIdx.y * (NW * 16);

  const bool in_shape = prm_ndim == 4;
  const int kv_lo = max(in_shape ? prm_shape[1] - 1 : prm[3 * b], 0);
  const int kv_hi = min(in_shape ? prm_shape[2] - 1 : prm[3 * b + 1], S);
  const int q_off = in_shape ? prm_shape[3] - (1 << 20) : prm[3 * b + 2];  // OFFSET_BIAS
  const float sl2 = scl[0];

  const long long qs0 = q_strides[0], qs1 = q_strides[1], qs2 = q_strides[2], qs3 = q_strides[3];
  const long long ks0 = k_strides[0], ks1 = k_strides[1], ks2 = k_strides[2], ks3 = k_strides[3];
  const long long vs0 = v_strides[0], vs1 = v_strides[1], vs2 = v_strides[2], vs3 = v_strides[3];
  const bool vec = qs3 == 1 && ks3 == 1 && vs3 == 1 &&
      ((qs0 | qs1 | qs2 | ks0 | ks1 | ks2 | vs0 | vs1 | vs2) & 7) == 0 &&
      ((reinterpret_cast<unsigned long long>(q) | reinterpret_cast<unsigned long long>(k) |
        reinterpret_cast<unsigned long long>(v)) & 15) == 0;
  const T* kb = k + b * ks0 + h * ks1;
  const T* vb = v + b * vs0 + h * vs1;

  // this split's key tiles, cut to the keys some row of the batch entry can see
  const int ntiles = (S + KB - 1) / KB;
  const int tps = (ntiles + nsplit - 1) / nsplit;
  const int key_top = max(min(kv_hi, q_off + L), 0);
  const int t_lo = max(split * tps, kv_lo / KB);
  const int t_hi = min(min(split * tps + tps, ntiles), (key_top + KB - 1) / KB);
  const int ntl = max(t_hi - t_lo, 0);

  // rows: r = g * L + i (query head h * G + g, query i); each lane holds rows ra and ra + 8
  const int wrow = row0 + warp * 16;
  const int g4 = lane >> 2, t4 = lane & 3;
  const int ra = wrow + g4, rb = ra + 8;
  const int lim_a = ra < M ? min(kv_hi, q_off + ra % L + 1) : -1;
  const int lim_b = rb < M ? min(kv_hi, q_off + rb % L + 1) : -1;
  int wlim = max(lim_a, lim_b);
  #pragma unroll
  for (int o = 1; o < 32; o <<= 1) wlim = max(wlim, __shfl_xor_sync(0xffffffffu, wlim, o));
  const bool wact = wrow < M;

  auto load_q = [&]() {
    for (int c = tid; c < NW * 16 * CH; c += NW * 32) {
      const int rr = c / CH, cc = c % CH, r = row0 + rr;
      const bool ok = r < M;
      const long long src = ok ? b * qs0 + (h * G + r / L) * qs1 + (r % L) * qs2 : 0;
      T* dst = Qs + rr * LDS + cc * 8;
      if (vec) {
        cp16(smem_u32(dst), q + (ok ? src + cc * 8 : 0), ok);
      } else {
        const unsigned short* s16 = reinterpret_cast<const unsigned short*>(q);
        unsigned short* d16 = reinterpret_cast<unsigned short*>(dst);
        for (int e = 0; e < 8; ++e) d16[e] = ok ? s16[src + (cc * 8 + e) * qs3] : (unsigned short)0;
      }
    }
  };
  auto load_kv = [&](int t, int buf) {
    T* kd = Ks + buf * KB * LDS;
    T* vd = Vs + buf * KB * LDS;
    for (int c = tid; c < KB * CH; c += NW * 32) {
      const int rr = c / CH, cc = c % CH, j = t * KB + rr;
      const bool ok = j >= kv_lo && j < kv_hi;  // garbage past key_len and left padding read as zeros
      if (vec) {
        cp16(smem_u32(kd + rr * LDS + cc * 8), ok ? kb + j * ks2 + cc * 8 : k, ok);
        cp16(smem_u32(vd + rr * LDS + cc * 8), ok ? vb + j * vs2 + cc * 8 : v, ok);
      } else {
        const unsigned short* k16 = reinterpret_cast<const unsigned short*>(kb);
        const unsigned short* v16 = reinterpret_cast<const unsigned short*>(vb);
        unsigned short* kd16 = reinterpret_cast<unsigned short*>(kd + rr * LDS + cc * 8);
        unsigned short* vd16 = reinterpret_cast<unsigned short*>(vd + rr * LDS + cc * 8);
        for (int e = 0; e < 8; ++e) {
          kd16[e] = ok ? k16[j * ks2 + (cc * 8 + e) * ks3] : (unsigned short)0;
          vd16[e] = ok ? v16[j * vs2 + (cc * 8 + e) * vs3] : (unsigned short)0;
        }
      }
    }
  };

  float o[NT][4];
  #pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;

  const unsigned q_addr = smem_u32(Qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
  const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8;
  const int v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;

  // every iteration commits one group (maybe empty), so waiting for all but the newest ST - 1 lands tile it
  if (ntl > 0) {
    load_q();
    #pragma unroll
    for (int st = 0; st < ST - 1; ++st) {
      if (st < ntl) load_kv(t_lo + st, st);
      cp_commit();
    }
  }
  for (int it = 0; it < ntl; ++it) {
    if (it + ST - 1 < ntl) load_kv(t_lo + it + ST - 1, (it + ST - 1) % ST);
    cp_commit();
    cp_wait<ST - 1>();
    __syncthreads();
    const int kbase = (t_lo + it) * KB;
    if (wact && kbase < wlim) {
      const unsigned k_addr = smem_u32(Ks + (it % ST) * KB * LDS + k_off);
      const unsigned v_addr = smem_u32(Vs + (it % ST) * KB * LDS + v_off);
      float s[SN][4];
      #pragma unroll
      for (int n = 0; n < SN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        ldsm4(q_addr + kk * 32, a);
        #pragma unroll
        for (int np = 0; np < KB / 16; ++np) {
          unsigned bk[4];
          ldsm4(k_addr + (np * 16 * LDS + kk * 16) * 2, bk);
          mma16816<BF>(s[2 * np], a, bk[0], bk[1]);
          mma16816<BF>(s[2 * np + 1], a, bk[2], bk[3]);
        }
      }
      float mx_a = NEG_INF, mx_b = NEG_INF;
      #pragma unroll
      for (int n = 0; n < SN; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = kbase + n * 8 + 2 * t4 + (e & 1);
          const bool ok = j >= kv_lo && j < (e < 2 ? lim_a : lim_b);
          s[n][e] = ok ? s[n][e] * sl2 : NEG_INF;
        }
        mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
      }
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
      const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
      const float mu_a = mn_a == NEG_INF ? 0.f : mn_a;  // a row with no key yet keeps p = 0, not NaN
      const float mu_b = mn_b == NEG_INF ? 0.f : mn_b;
      const float al_a = exp2f(m_a - mu_a), al_b = exp2f(m_b - mu_b);
      float sum_a = 0.f, sum_b = 0.f;
      #pragma unroll
      for (int n = 0; n < SN; ++n) {
        s[n][0] = exp2f(s[n][0] - mu_a);
        s[n][1] = exp2f(s[n][1] - mu_a);
        s[n][2] = exp2f(s[n][2] - mu_b);
        s[n][3] = exp2f(s[n][3] - mu_b);
        sum_a += s[n][0] + s[n][1];
        sum_b += s[n][2] + s[n][3];
      }
      l_a = l_a * al_a + sum_a;
      l_b = l_b * al_b + sum_b;
      m_a = mn_a;
      m_b = mn_b;
      #pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][0] *= al_a; o[n][1] *= al_a; o[n][2] *= al_b; o[n][3] *= al_b;
      }
      #pragma unroll
      for (int kk = 0; kk < KB / 16; ++kk) {
        unsigned a[4];  // the score accumulators' layout is the A operand's: P stays in registers
        a[0] = pack2(s[2 * kk][0], s[2 * kk][1], T());
        a[1] = pack2(s[2 * kk][2], s[2 * kk][3], T());
        a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T());
        a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T());
        #pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          unsigned bv[4];
          ldsm4t(v_addr + (kk * 16 * LDS + dp * 16) * 2, bv);
          mma16816<BF>(o[2 * dp], a, bv[0], bv[1]);
          mma16816<BF>(o[2 * dp + 1], a, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // a later iteration's load overwrites this buffer
  }

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  if (wact) {
    #pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = hf ? rb : ra;
      if (r < M) {
        const float mrow = hf ? m_b : m_a, lrow = hf ? l_b : l_a;
        const int i = r % L, hq = h * G + r / L;
        if (nsplit == 1) {
          const float inv = lrow > 0.f ? 1.f / lrow : 0.f;
          unsigned* dst = reinterpret_cast<unsigned*>(out + ((long long)(b * L + i) * Hq + hq) * D);
          #pragma unroll
          for (int n = 0; n < NT; ++n) dst[n * 4 + t4] = pack2(o[n][2 * hf] * inv, o[n][2 * hf + 1] * inv, T());
        } else {
          const long long prow = (long long)split * Bn * Hq * L + ((long long)b * Hq + hq) * L + i;
          float2* dst = reinterpret_cast<float2*>(opart + prow * D);
          #pragma unroll
          for (int n = 0; n < NT; ++n) dst[n * 4 + t4] = make_float2(o[n][2 * hf], o[n][2 * hf + 1]);
          if (t4 == 0) {
            ml[prow * 2] = mrow;
            ml[prow * 2 + 1] = lrow;
          }
        }
      }
    }
  }
"""

# one thread per (row, 4 channels): merges the splits' partial softmaxes into out [B, L, Hq, D]
_COMBINE_THREAD = r"""
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int nsplit = opart_shape[0], Hq = opart_shape[2], L = opart_shape[3];
  const int R = opart_shape[1] * Hq * L;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int row = (int)(idx / (D / 4)), c = (int)(idx % (D / 4));
  if (row >= R) return;
  float mmax = NEG_INF;
  for (int s = 0; s < nsplit; ++s) mmax = fmaxf(mmax, ml[((long long)s * R + row) * 2]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float den = 0.f;
  if (mmax != NEG_INF) {
    for (int s = 0; s < nsplit; ++s) {
      const long long pr = (long long)s * R + row;
      const float m = ml[pr * 2];
      if (m == NEG_INF) continue;  // an empty split wrote no channels
      const float w = exp2f(m - mmax);
      den += w * ml[pr * 2 + 1];
      const float4 x = reinterpret_cast<const float4*>(opart + pr * D)[c];
      acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
    }
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  const int b = row / (Hq * L), hq = (row / L) % Hq, i = row % L;
  uint2 pk;
  pk.x = pack2(acc.x * inv, acc.y * inv, T());
  pk.y = pack2(acc.z * inv, acc.w * inv, T());
  reinterpret_cast<uint2*>(out + ((long long)(b * L + i) * Hq + hq) * D)[c] = pk;
"""

# one warp per row, lanes over splits for the weights and over channels (D / 32 each) for the sum: the
# splits' loads are independent, so they overlap (every split wrote its rows: empty ones m = -inf, O = 0)
_COMBINE_WARP = r"""
  constexpr int CPL = D / 32;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int nsplit = opart_shape[0], Hq = opart_shape[2], L = opart_shape[3];
  const int R = opart_shape[1] * Hq * L;
  const int row = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= R) return;  // whole warps
  float mmax = NEG_INF;
  for (int s = lane; s < nsplit; s += 32) mmax = fmaxf(mmax, ml[((long long)s * R + row) * 2]);
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
  const float mu = mmax == NEG_INF ? 0.f : mmax;
  float acc[CPL];
  #pragma unroll
  for (int e = 0; e < CPL; ++e) acc[e] = 0.f;
  float den = 0.f;
  for (int s0 = 0; s0 < nsplit; s0 += 32) {
    const int s = s0 + lane;
    float w = 0.f;
    if (s < nsplit) {
      const long long pr = (long long)s * R + row;
      w = exp2f(ml[pr * 2] - mu);
      den += w * ml[pr * 2 + 1];
    }
    const int cnt = min(32, nsplit - s0);
    #pragma unroll 8
    for (int t = 0; t < cnt; ++t) {
      const float wt = __shfl_sync(0xffffffffu, w, t);
      const float* src = opart + ((long long)(s0 + t) * R + row) * D + lane * CPL;
      if constexpr (CPL == 2) {
        const float2 x = *reinterpret_cast<const float2*>(src);
        acc[0] += wt * x.x; acc[1] += wt * x.y;
      } else {
        #pragma unroll
        for (int e = 0; e < CPL; e += 4) {
          const float4 x = *reinterpret_cast<const float4*>(src + e);
          acc[e] += wt * x.x; acc[e + 1] += wt * x.y; acc[e + 2] += wt * x.z; acc[e + 3] += wt * x.w;
        }
      }
    }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  const float inv = den > 0.f ? 1.f / den : 0.f;
  const int b = row / (Hq * L), hq = (row / L) % Hq, i = row % L;
  unsigned* dst = reinterpret_cast<unsigned*>(out + ((long long)(b * L + i) * Hq + hq) * D + lane * CPL);
  #pragma unroll
  for (int e = 0; e < CPL; e += 2) dst[e / 2] = pack2(acc[e] * inv, acc[e + 1] * inv, T());
"""

_KERNELS: Dict[Tuple[int, str], Tuple[object, object]] = {}
_SCALES: Dict[float, mx.array] = {}
_LAUNCH: Dict[tuple, tuple] = {}
_ZERO: List[mx.array] = []


def _kernels(head_dim: int, variant: str) -> Tuple[object, object]:
    key = (head_dim, variant)
    if key not in _KERNELS:  # NVRTC runs at the first launch of each template instance, then MLX caches it
        warp = VARIANTS[variant].combine == "warp"
        main = mx.fast.cuda_kernel(
            name="spec_attn_split", input_names=["q", "k", "v", "prm", "scl"],
            output_names=["opart", "ml", "out"], source=_MAIN, header=_HEADER,
            ensure_row_contiguous=False, shared_memory=shared_bytes(head_dim, variant))
        combine = mx.fast.cuda_kernel(
            name="spec_attn_combine_warp" if warp else "spec_attn_combine", input_names=["opart", "ml"],
            output_names=["out"], source=_COMBINE_WARP if warp else _COMBINE_THREAD, header=_HEADER)
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
    main, combine = _kernels(D, variant)
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
        template=[("T", dtype), ("D", D), ("KB", tile_keys(D, variant)), ("ST", VARIANTS[variant].stages),
                  ("BF", dtype == mx.bfloat16)],
        grid=(splits * WARPS * 32, chunks, B * Hkv), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(splits, B, Hq, L, D) if many else (1,), (splits, B, Hq, L, 2) if many else (1,),
                       (1,) if many else (B, L, Hq, D)],
        output_dtypes=[mx.float32, mx.float32, dtype])
    combine_args = dict(template=[("T", dtype), ("D", D)], grid=(B * Hq * L * (32 if warp else D // 4), 1, 1),
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
