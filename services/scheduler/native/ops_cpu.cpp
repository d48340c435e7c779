// The decoder's small ops fused into one pass each (CPU, float32 and bfloat16).
//
// At batch 1 a decode step is hundreds of small torch calls; each of these replaces several
// of them (and the temporaries between them) with one call that reads its input once:
//
//   add_rms_norm_(residual, x, w)   residual += x, then x = rms_norm(residual) * w (in place)
//   rms_norm_(x, w, out)            out = rms_norm(x) * w; out may be x; x [A, B, n] strided
//   rotary_(x, heads, positions, cos, sin)   the first `heads` heads of x [T, H, D] (q's and
//                                   k's, side by side in qkv) rotated in place (the halves of
//                                   each head, as transformers' rotate_half); cos/sin [L, D/2]
//                                   read at each token's position
//   silu_and_mul(gu) / gelu_tanh_and_mul(gu)   [T, 2I] -> [T, I]: act(gate) * up
//   argmax_rows(x)                  [M, V] -> int64 [M]: greedy sampling's pick, as
//                                   torch.argmax(-1) gives it (the first maximum; a NaN
//                                   counts as the maximum, the first NaN then)
//   lora_add_(out, x, at, b, cols, index, start, count)   a LoRA's low-rank part for a
//                                   decode step's rows: out[m] += (x[m] @ at.T) @ b, m the
//                                   rows start..+count (or index's), at [R, K] (A
//                                   transposed), b [R, N]; cols [R, 2] int32: the columns
//                                   [lo, hi) outside which b's row r is zero (a fused
//                                   projection's other shards), skipped
//
// Every sum and product runs in float32 whatever the storage dtype; a bfloat16 result is
// rounded once (to nearest even) when it is stored.
//
// Threads: rows are independent, but a decode step's ops are small (a 64-row norm is ~5 us of
// work on one core) and waking the OpenMP workers that the matmul before left asleep costs
// more than that: 10-100 us with sleeping waiters (OMP_WAIT_POLICY=PASSIVE), more whenever
// another process holds the other core. Measured in a decode step at batch 64, the fused ops
// took 75-150 us a call split over two threads and 10-45 us on the calling thread alone. So an
// op runs on the calling thread below kParallelWork elements and splits its rows only above
// (a prefill chunk's).
//
// AVX-512 (F + BW + VL) where the compiler targets it (-march=native), else AVX2 + FMA (8
// lanes, the same arithmetic: Zen 2/3 EPYCs, older Xeons); the scalar loops are the portable
// path and handle every tail. The compiler left the scalar loops of argmax and of the
// activations unvectorized or calling libmvec's expf: on an AVX2 EPYC (SmolLM2 float32, 64
// rows) argmax over 49,152 logits took 2.9 ms, 1.6x torch's own, and silu_and_mul 111 us.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TL_AVX512 1
#else
#define TL_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if !TL_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define TL_AVX2 1
#else
#define TL_AVX2 0
#endif

namespace {

using bf16 = uint16_t;  // bfloat16 storage: the high half of a float32

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  // round to nearest, ties to even; a NaN stays a (quiet) NaN. A select, not a branch: the
  // loops around it vectorize
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;
  *p = static_cast<bf16>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#if TL_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  bits = _mm512_mask_or_epi32(bits, nan, _mm512_castps_si512(v), _mm512_set1_epi32(0x400000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
}
#endif

// 8-lane helpers: the AVX2 loops' (TL_AVX2) and the LoRA product's, which runs on every x86
#if defined(__AVX2__) && defined(__FMA__)
using tokenline::load8;  // cpu_vec.h
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// store()'s rounding, 8 lanes: to nearest even, a NaN kept (quiet); the NaN test on the bits
// (-ffast-math may take an unordered compare to be false)
inline void store8(bf16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  // 32 -> 16 bits within each 128-bit half, then the halves' low quadwords side by side
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// a / b rounded once, as vdivps gives it: under -ffast-math the compiler turns _mm256_div_ps
// into a reciprocal estimate and a Newton step (1-2 ulp), which moved a SmolLM2's logits
// measurably (silu's g / (1 + e) in every layer)
inline __m256 div8(__m256 a, __m256 b) {
  __m256 q;
  asm("vdivps %2, %1, %0" : "=x"(q) : "x"(a), "x"(b));
  return q;
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Below this many elements an op runs on the calling thread (see the top of the file): a
// 64-row step's norms, rotary and activation all do; a prefill chunk's split across threads.
constexpr int64_t kParallelWork = 1 << 18;

// f(begin, end) over rows of row_elems elements each: inline when small, else split
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t elems = std::max<int64_t>(1, row_elems);
  if (rows * elems < kParallelWork) {
    f(0, rows);
    return;
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelWork / 2 / elems), f);
}

template <typename T>
float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if TL_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif TL_AVX2
  // in float64: one float32 vector's sums, in this order, moved a LoRA'd SmolLM2's logits
  // (tests/unit/test_lora.py) from 5.8e-4 of float64's to 1.1e-3; a row is ~1,000 values
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    lo = _mm256_fmadd_pd(a, a, lo);
    hi = _mm256_fmadd_pd(b, b, hi);
  }
  lo = _mm256_add_pd(lo, hi);
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(lo), _mm256_extractf128_pd(lo, 1));
  sum = static_cast<float>(_mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h))));
#endif
  for (; i < n; ++i) sum += to_f(x[i]) * to_f(x[i]);
  return sum;
}

// out[i] = x[i] * inv * w[i]: the product in float32, rounded once on store
template <typename T, typename W>
void scale_row(const T* x, const W* w, T* out, int64_t n, float inv) {
  int64_t i = 0;
#if TL_AVX512
  const __m512 s = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), s), load16(w + i)));
#elif TL_AVX2
  const __m256 s = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), s), load8(w + i)));
#endif
  for (; i < n; ++i) store(out + i, to_f(x[i]) * inv * to_f(w[i]));
}

template <typename T, typename W>
void add_rms_norm_impl(T* residual, T* x, const W* w, int64_t rows, int64_t n, int64_t rs,
                       int64_t xs, float eps) {
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * rs;
      T* xr = x + r * xs;
      // residual += x, stored (and rounded) first: the norm reads the stored residual, as the
      // unfused ops do
      int64_t i = 0;
#if TL_AVX512
      for (; i + 16 <= n; i += 16) store16(res + i, _mm512_add_ps(load16(res + i), load16(xr + i)));
#elif TL_AVX2
      for (; i + 8 <= n; i += 8) store8(res + i, _mm256_add_ps(load8(res + i), load8(xr + i)));
#endif
      for (; i < n; ++i) store(res + i, to_f(res[i]) + to_f(xr[i]));
      const float inv = 1.f / std::sqrt(sum_squares(res, n) / static_cast<float>(n) + eps);
      scale_row(res, w, xr, n, inv);
    }
  });
}

template <typename T, typename W>
void rms_norm_impl(const T* x, const W* w, T* out, int64_t A, int64_t B, int64_t n,
                   int64_t xa, int64_t xb, int64_t oa, int64_t ob, float eps) {
  for_rows(A * B, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / B, b = r % B;
      const T* xr = x + a * xa + b * xb;
      const float inv = 1.f / std::sqrt(sum_squares(xr, n) / static_cast<float>(n) + eps);
      scale_row(xr, w, out + a * oa + b * ob, n, inv);
    }
  });
}

// one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), halves of `half` values each
template <typename T>
void rotate_head(T* x, const float* c, const float* s, int64_t half) {
  T* x2p = x + half;
  int64_t i = 0;
#if TL_AVX512
  for (; i + 16 <= half; i += 16) {
    __m512 x1 = load16(x + i), x2 = load16(x2p + i);
    __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
    store16(x + i, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)));
    store16(x2p + i, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)));
  }
#elif TL_AVX2
  for (; i + 8 <= half; i += 8) {
    __m256 x1 = load8(x + i), x2 = load8(x2p + i);
    __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    store8(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    store8(x2p + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x2p[i]);
    store(x + i, x1 * c[i] - x2 * s[i]);
    store(x2p + i, x2 * c[i] + x1 * s[i]);
  }
}

template <typename T>
void rotary_impl(T* x, const int64_t* pos, const float* cos, const float* sin, int64_t tokens,
                 int64_t heads, int64_t D, int64_t st, int64_t sh) {
  const int64_t half = D / 2;
  for_rows(tokens, heads * D, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head(x + t * st + h * sh, c, s, half);
    }
  });
}

#if TL_AVX512
// a / b for b >= 1 (finite): rcp14's estimate of 1 / b sharpened by one Newton step, then
// times a: within ~2 ulp of a true division, at a fifth of vdivps's cost (which was half the
// activation's time)
inline __m512 div16(__m512 a, __m512 b) {
  __m512 x = _mm512_rcp14_ps(b);
  x = _mm512_fmadd_ps(x, _mm512_fnmadd_ps(b, x, _mm512_set1_ps(1.f)), x);
  return _mm512_mul_ps(a, x);
}
#endif

// exp's argument is clamped: -ffast-math assumes no infinities, so exp must not overflow
// (past the clamps both results are already saturated in float32). With AVX-512 sixteen
// lanes at a time through exp16 (a decode step's 64 x 1,536 SmolLM2 activation: 200 us in
// the scalar loop, which did not vectorize, against 55 us); the scalar loop, through std::exp
// (libmvec where the compiler vectorizes it), takes the tails and the portable build.
struct Silu {
  static float apply(float g) { return g / (1.f + std::exp(std::min(-g, 80.f))); }
#if TL_AVX512
  static __m512 apply16(__m512 g) {
    const __m512 e = tokenline::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return div16(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  }
#elif TL_AVX2
  static __m256 apply8(__m256 g) {
    const __m256 e = tokenline::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return div8(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
#endif
};
struct GeluTanh {
  // u = sqrt(2 / pi) (g + 0.044715 g^3)
  static constexpr float kC = 0.7978845608028654f, kK = 0.044715f;
  static float apply(float g) {
    // 1 + tanh(u) = 2e / (e + 1), e = exp(2u): one exp, which vectorizes (libmvec), and no
    // cancellation for negative u, where 2 - 2 / (e + 1) (the same value) loses all of it:
    // there it left 2^-23 where the answer is 0 once the division was the compiler's estimate
    // (AVX2, 052abb1). Every path computes this form.
    const float u = kC * (g + kK * g * g * g);
    const float e = std::exp(std::min(std::max(2.f * u, -80.f), 80.f));
    return 0.5f * g * (2.f * e / (e + 1.f));
  }
#if TL_AVX512
  static __m512 apply16(__m512 g) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kC), _mm512_fmadd_ps(_mm512_set1_ps(kK), g3, g));
    const __m512 e = tokenline::exp16(_mm512_add_ps(u, u));
    const __m512 t = div16(_mm512_add_ps(e, e), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), t);
  }
#elif TL_AVX2
  static __m256 apply8(__m256 g) {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kC), _mm256_fmadd_ps(_mm256_set1_ps(kK), g3, g));
    // 1 + tanh(u) as 2e / (e + 1), as in apply above
    const __m256 e = tokenline::exp8(_mm256_add_ps(u, u));
    const __m256 t = div8(_mm256_add_ps(e, e), _mm256_add_ps(e, _mm256_set1_ps(1.f)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), t);
  }
#endif
};

template <typename Act, typename T>
void act_and_mul_impl(const T* gu, T* out, int64_t rows, int64_t inter, int64_t gs) {
  for_rows(rows, 2 * inter, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * gs;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if TL_AVX512
      for (; i + 16 <= inter; i += 16)
        store16(o + i, _mm512_mul_ps(Act::apply16(load16(g + i)), load16(u + i)));
#elif TL_AVX2
      for (; i + 8 <= inter; i += 8)
        store8(o + i, _mm256_mul_ps(Act::apply8(load8(g + i)), load8(u + i)));
#endif
#pragma omp simd
      for (int64_t j = i; j < inter; ++j) store(o + j, Act::apply(to_f(g[j])) * to_f(u[j]));
    }
  });
}

// The index torch.argmax gives for one row: the first NaN if there is one, else the first
// element equal to the maximum (-0 and +0 are equal, as torch's comparison has them). Two passes
// over a row that stays in L2 (a 49,152-entry vocabulary is 192 KiB in float32): one for the
// maximum and whether a NaN is there, vectorized; one that stops at the first match. torch's
// argmax over [64, 49,152] float32 logits took 5.2 ms on the AMX Xeon VM, its amax 0.4: a
// bfloat16 decode64 step is ~70 ms.
// NaN tests on the bits: the build is -ffast-math, under which the compiler takes std::isnan
// (and an unordered compare) to be false
inline bool nan_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#if TL_AVX512
  __m512 acc = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    nans |= _mm512_cmpgt_epi32_mask(bits, inf);
    acc = _mm512_max_ps(acc, v);
  }
  best = _mm512_reduce_max_ps(acc);
  nan = nans != 0;
#elif TL_AVX2
  __m256 acc = _mm256_set1_ps(-INFINITY);
  __m256i nans = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
    nans = _mm256_or_si256(nans, _mm256_cmpgt_epi32(bits, inf));
    acc = _mm256_max_ps(acc, v);  // a NaN's lane: whatever, the NaN pass below answers
  }
  acc = _mm256_max_ps(acc, _mm256_permute2f128_ps(acc, acc, 1));
  acc = _mm256_max_ps(acc, _mm256_shuffle_ps(acc, acc, _MM_SHUFFLE(1, 0, 3, 2)));
  acc = _mm256_max_ps(acc, _mm256_shuffle_ps(acc, acc, _MM_SHUFFLE(2, 3, 0, 1)));
  best = _mm256_cvtss_f32(acc);
  nan = !_mm256_testz_si256(nans, nans);
#endif
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    nan |= nan_bits(v);
    best = v > best ? v : best;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (nan_bits(to_f(x[j]))) return j;
  }
  int64_t j = 0;
#if TL_AVX512
  const __m512 target = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + j), target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#elif TL_AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + j), target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < n; ++j)
    if (to_f(x[j]) == best) return j;
  return 0;  // not reached: without a NaN the maximum is one of the row's elements
}


// out[rows] += (x[rows] @ at.T) @ b for a decode step's rows of one adapter, on the calling
// thread: the low-rank product is ~1e5 multiply-adds a row and projection, less than waking
// the OpenMP workers costs. Rows go in blocks of MB (4, then the rest), so each of A's and
// b's rows is read once a block: t = x @ A as dot products over K (A given transposed,
// [R, K]), then b's columns 16 at a time with the block's sums in registers, skipping b's
// rows that are zero there (cols), and out read and written once. Sums in float32; out
// rounded once. AVX2 + FMA intrinsics (every x86 machine we serve on; compilers did not keep
// the blocked sums in registers on their own); elsewhere a plain loop per row.
constexpr int64_t kLoraCols = 16;

#if defined(__AVX2__) && defined(__FMA__)  // load8, hsum8: at the top

template <int MB, typename T, typename W>
void lora_rows(T* const* out, const float* xf, const W* at, const W* b, const int32_t* cols,
               int64_t K, int64_t R, int64_t N, float* t) {
  for (int64_t r = 0; r < R; ++r) {
    const W* ar = at + r * K;
    __m256 s[MB];
    for (int mb = 0; mb < MB; ++mb) s[mb] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 av = load8(ar + k);
      for (int mb = 0; mb < MB; ++mb) s[mb] = _mm256_fmadd_ps(load8(xf + mb * K + k), av, s[mb]);
    }
    for (int mb = 0; mb < MB; ++mb) {
      float sum = hsum8(s[mb]);
      for (int64_t kk = k; kk < K; ++kk) sum += xf[mb * K + kk] * to_f(ar[kk]);
      t[mb * R + r] = sum;
    }
  }
  int64_t j0 = 0;
  for (; j0 + kLoraCols <= N; j0 += kLoraCols) {
    __m256 acc[MB][2];
    for (int mb = 0; mb < MB; ++mb) acc[mb][0] = acc[mb][1] = _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
      if (cols[2 * r] >= j0 + kLoraCols || cols[2 * r + 1] <= j0) continue;
      const __m256 b0 = load8(b + r * N + j0), b1 = load8(b + r * N + j0 + 8);
      for (int mb = 0; mb < MB; ++mb) {
        const __m256 tm = _mm256_set1_ps(t[mb * R + r]);
        acc[mb][0] = _mm256_fmadd_ps(tm, b0, acc[mb][0]);
        acc[mb][1] = _mm256_fmadd_ps(tm, b1, acc[mb][1]);
      }
    }
    for (int mb = 0; mb < MB; ++mb) {
      float sums[kLoraCols];
      _mm256_storeu_ps(sums, acc[mb][0]);
      _mm256_storeu_ps(sums + 8, acc[mb][1]);
      for (int i = 0; i < kLoraCols; ++i)
        store(out[mb] + j0 + i, to_f(out[mb][j0 + i]) + sums[i]);
    }
  }
  for (int64_t j = j0; j < N; ++j)  // the last columns, fewer than 16
    for (int mb = 0; mb < MB; ++mb) {
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r) sum += t[mb * R + r] * to_f(b[r * N + j]);
      store(out[mb] + j, to_f(out[mb][j]) + sum);
    }
}
#else
template <int MB, typename T, typename W>
void lora_rows(T* const* out, const float* xf, const W* at, const W* b, const int32_t* cols,
               int64_t K, int64_t R, int64_t N, float* t) {
  std::vector<float> acc(N);
  for (int mb = 0; mb < MB; ++mb) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xf[mb * K + k] * to_f(at[r * K + k]);
      t[r] = sum;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = cols[2 * r]; j < cols[2 * r + 1]; ++j) acc[j] += t[r] * to_f(b[r * N + j]);
    for (int64_t j = 0; j < N; ++j) store(out[mb] + j, to_f(out[mb][j]) + acc[j]);
  }
}
#endif

template <typename T, typename W>
void lora_add_impl(T* out, const T* x, const W* at, const W* b, const int32_t* cols,
                   const int64_t* rows, int64_t M, int64_t K, int64_t R, int64_t N,
                   int64_t out_ld, int64_t x_ld) {
  constexpr int MB = 4;
  std::vector<float> xf(MB * K), t(MB * R);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int n = static_cast<int>(std::min<int64_t>(MB, M - m0));
    T* orow[MB];
    for (int i = 0; i < n; ++i) {
      const T* xr = x + rows[m0 + i] * x_ld;
      for (int64_t k = 0; k < K; ++k) xf[i * K + k] = to_f(xr[k]);
      orow[i] = out + rows[m0 + i] * out_ld;
    }
    switch (n) {
      case 4: lora_rows<4>(orow, xf.data(), at, b, cols, K, R, N, t.data()); break;
      case 3: lora_rows<3>(orow, xf.data(), at, b, cols, K, R, N, t.data()); break;
      case 2: lora_rows<2>(orow, xf.data(), at, b, cols, K, R, N, t.data()); break;
      default: lora_rows<1>(orow, xf.data(), at, b, cols, K, R, N, t.data());
    }
  }
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

void check_dtype(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || is_bf16(t), what,
              ": float32 or bfloat16 only, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
}

template <typename T>
T* ptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T>
const T* cptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

// W: the norm's weight, float32 or the activations' own dtype
#define TL_DISPATCH_NORM(x, w, ...)                                      \
  if (!is_bf16(x)) {                                                     \
    TORCH_CHECK(!is_bf16(w), "a bfloat16 norm weight needs bfloat16 x"); \
    using T = float; using W = float; __VA_ARGS__;                       \
  } else if (is_bf16(w)) {                                               \
    using T = bf16; using W = bf16; __VA_ARGS__;                         \
  } else {                                                               \
    using T = bf16; using W = float; __VA_ARGS__;                        \
  }

}  // namespace

torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                            double eps) {
  check_dtype(x, "add_rms_norm_");
  check_dtype(weight, "add_rms_norm_");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "add_rms_norm_: one dtype");
  TORCH_CHECK(residual.dim() == 2 && x.sizes() == residual.sizes(),
              "add_rms_norm_: residual and x [T, n] of one shape");
  TORCH_CHECK(residual.stride(1) == 1 && x.stride(1) == 1 && weight.is_contiguous() &&
              weight.numel() == x.size(1), "add_rms_norm_: rows contiguous, weight [n]");
  const int64_t rows = x.size(0), n = x.size(1);
  TL_DISPATCH_NORM(x, weight, add_rms_norm_impl<T, W>(ptr<T>(residual), ptr<T>(x),
                                                      cptr<W>(weight), rows, n,
                                                      residual.stride(0), x.stride(0),
                                                      static_cast<float>(eps)));
  return x;
}

torch::Tensor rms_norm_(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  check_dtype(x, "rms_norm_");
  check_dtype(weight, "rms_norm_");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes(),
              "rms_norm_: out of x's dtype and shape");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm_: x [T, n] or [T, H, n]");
  TORCH_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1 && weight.is_contiguous() &&
              weight.numel() == x.size(-1), "rms_norm_: rows contiguous, weight [n]");
  const bool three = x.dim() == 3;
  const int64_t A = x.size(0), B = three ? x.size(1) : 1, n = x.size(-1);
  const int64_t xb = three ? x.stride(1) : 0, ob = three ? out.stride(1) : 0;
  TL_DISPATCH_NORM(x, weight, rms_norm_impl<T, W>(cptr<T>(x), cptr<W>(weight), ptr<T>(out), A,
                                                  B, n, x.stride(0), xb, out.stride(0), ob,
                                                  static_cast<float>(eps)));
  return out;
}

torch::Tensor rotary_(torch::Tensor x, int64_t heads, torch::Tensor positions,
                      torch::Tensor cos, torch::Tensor sin) {
  check_dtype(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
              x.stride(1) >= x.size(2), "rotary_: x [T, H, D], heads contiguous, D even");
  TORCH_CHECK(heads >= 0 && heads <= x.size(1), "rotary_: heads ", heads, " of ", x.size(1));
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.dim() == 2 && cos.size(1) == x.size(2) / 2,
              "rotary_: cos and sin float32 [L, D/2], contiguous");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
              positions.numel() == x.size(0), "rotary_: positions int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t T = x.size(0), L = cos.size(0);
  for (int64_t t = 0; t < T; ++t)  // checked here: an error cannot leave a parallel region
    TORCH_CHECK(pos[t] >= 0 && pos[t] < L, "rotary_: position ", pos[t], " outside the table");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  if (is_bf16(x))
    rotary_impl(ptr<bf16>(x), pos, c, s, T, heads, x.size(2), x.stride(0), x.stride(1));
  else
    rotary_impl(ptr<float>(x), pos, c, s, T, heads, x.size(2), x.stride(0), x.stride(1));
  return x;
}

template <typename Act>
torch::Tensor act_and_mul(const torch::Tensor& gu, const char* what) {
  check_dtype(gu, what);
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, what,
              ": gate_up [T, 2I], rows contiguous");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto out = torch::empty({rows, inter}, gu.options());
  if (is_bf16(gu))
    act_and_mul_impl<Act>(cptr<bf16>(gu), ptr<bf16>(out), rows, inter, gu.stride(0));
  else
    act_and_mul_impl<Act>(cptr<float>(gu), ptr<float>(out), rows, inter, gu.stride(0));
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor gu) { return act_and_mul<Silu>(gu, "silu_and_mul"); }
torch::Tensor gelu_tanh_and_mul(torch::Tensor gu) {
  return act_and_mul<GeluTanh>(gu, "gelu_tanh_and_mul");
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_dtype(x, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x [M, V], rows contiguous, V > 0");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf = is_bf16(x);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = bf ? argmax_row(cptr<bf16>(x) + r * ld, n) : argmax_row(cptr<float>(x) + r * ld, n);
  });
  return out;
}

torch::Tensor lora_add_(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a,
                        const torch::Tensor& b, const torch::Tensor& cols,
                        const torch::Tensor& index, int64_t start, int64_t count) {
  check_dtype(out, "lora_add_");
  check_dtype(a, "lora_add_");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && b.scalar_type() == a.scalar_type(),
              "lora_add_: x of out's dtype, b of a's");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) &&
              out.stride(1) == 1 && x.stride(1) == 1, "lora_add_: out, x [T, *], rows contiguous");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() &&
              a.size(1) == x.size(1) && b.size(0) == a.size(0) && b.size(1) == out.size(1),
              "lora_add_: at [R, K] (a transposed), b [R, N] contiguous");
  const int64_t K = a.size(1), R = a.size(0), N = b.size(1);
  TORCH_CHECK(cols.scalar_type() == torch::kInt32 && cols.is_contiguous() &&
              cols.numel() == 2 * R, "lora_add_: cols int32 [R, 2]");
  const int32_t* c = cols.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= c[2 * r] && c[2 * r] <= c[2 * r + 1] && c[2 * r + 1] <= N,
                "lora_add_: cols row ", r, " outside [0, ", N, "]");
  std::vector<int64_t> rows;
  if (index.numel() > 0) {
    TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.is_contiguous() &&
                index.dim() == 1, "lora_add_: index int64 [m]");
    rows.assign(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  } else {
    for (int64_t m = start; m < start + count; ++m) rows.push_back(m);
  }
  for (int64_t m : rows)
    TORCH_CHECK(0 <= m && m < out.size(0), "lora_add_: row ", m, " outside [0, ", out.size(0), ")");
  const int64_t M = rows.size();
  const int64_t ol = out.stride(0), xl = x.stride(0);
#define TL_LORA(T, W)                                                                      \
  lora_add_impl<T, W>(ptr<T>(out), cptr<T>(x), cptr<W>(a), cptr<W>(b), c, rows.data(), M, K, \
                      R, N, ol, xl)
  if (!is_bf16(out))
    is_bf16(a) ? TL_LORA(float, bf16) : TL_LORA(float, float);
  else
    is_bf16(a) ? TL_LORA(bf16, bf16) : TL_LORA(bf16, float);
#undef TL_LORA
  return out;
}

// which loops this build runs: what -march=native gave for this CPU (the start-up log names it)
std::string isa() { return TL_AVX512 ? "avx512" : TL_AVX2 ? "avx2" : "portable"; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * w (in place)");
  m.def("rms_norm_", &rms_norm_, "out = rms_norm(x) * w (out may be x)");
  m.def("rotary_", &rotary_, "rotate the first heads of x in place, tables read by position");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] gate_up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up of [T, 2I] gate_up");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(-1) (first max, NaN first)");
  m.def("lora_add_", &lora_add_, "out[rows] += (x[rows] @ a) @ b for a few rows (LoRA)");
  m.def("isa", &isa, "the vector loops compiled in: avx512, avx2 or portable");
}
