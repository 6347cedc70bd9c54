"""CUDA sources of the short-query attention kernel (plugin/cuda/cuda_attention.py compiles them with
``mx.fast.cuda_kernel``; constants it puts before each source: T the dtype, D the head dim, KB keys per
tile, ST pipeline stages, BF whether T is bfloat16). Kept apart so that the Python side reads on its own."""

import re


def dtype_consts(bf16: bool) -> str:
    """The source line naming the element type T (and BF, whether it is bfloat16) of a kernel instance."""
    return f"typedef {'__nv_bfloat16' if bf16 else '__half'} T; constexpr bool BF = {str(bf16).lower()};\n"


def compact(code: str) -> str:
    """The source without comments and indentation: MLX copies and hashes it at every launch."""
    lines = (re.sub(r"\s*//.*$", "", line).strip() for line in code.splitlines())
    return "\n".join(line for line in lines if line)


MMA16816 = r"""// c[16x8] += a[16x16] b[16x8], f32 accumulation
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
"""  # shared with plugin/cuda/cuda_matmul.py

HEADER = r"""
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
""" + MMA16816 + r"""__device__ __forceinline__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
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
MAIN = r"""
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
COMBINE_THREAD = r"""
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
COMBINE_WARP = r"""
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
