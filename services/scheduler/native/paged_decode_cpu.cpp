// Decode attention straight from the paged KV cache on CPU (float32 or bfloat16): the step's
// new K/V rows written into the cache and every decode row attended to, in one call per layer.
//
// The torch path gathers each request's blocks into a padded copy, then runs SDPA over the
// copy: the cache is read, written and read again. Here the cache is read once, a block at a
// time: a block holds page_size rows of all KV heads side by side (page * Hkv * D values, one
// contiguous span), so each block comes from memory once (its rows prefetched a tile ahead of
// their use: see attend_piece) and then serves every query head of the request from L1.
//
//   q        [T, Hq, D]        strided is fine (the rows of the qkv projection, as they come)
//   k, v     [T, Hkv, D]       the step's new rows, written to slot_mapping[t] first (optional)
//   k_cache  [S, Hkv, D]       S = num_blocks * page_size; position p of request b lives in
//   v_cache  [S, Hkv, D]       slot tables[b, p / page_size] * page_size + p % page_size
//   tables   [B, W] int32      entries past a request's end are never read
//   seq_lens [B] int32         positions [0, seq_lens[b]) are attended to, or with a sliding
//   window   int64             window W > 0 only the last W of them
//   rows, tokens [N] int64     (optional) decode row n is request rows[n], its query and output
//                              row tokens[n]; without them row n is request n and token n
//   out      [T, Hq, D]
//
// Work: each request's positions are cut into pieces of whole blocks (one piece per request
// at batch 64, a few per request at batch 1, so both cores have work), the pieces sorted
// longest first and handed out one at a time from a shared counter: the cores stay balanced
// however the lengths vary, and a core slowed by another process simply takes fewer pieces.
// A piece keeps, per query head, a running max m, sum l and weighted value sum acc (online
// softmax over tiles of up to 16 rows); a request cut into pieces is merged by whichever core
// finishes its last piece: out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M).
// Sums run in float32 in a different order from SDPA's: results agree to ~1e-6.
//
// With AVX-512 a tile's scores for one query head are one 16-lane vector: the 16 rows' dot
// products are summed into it by a shuffle tree, the exp is a vector polynomial. bfloat16 (q,
// caches and out all bf16; scores, softmax and sums float32): with AVX512-BF16 the q.k dots
// are _mm512_dpbf16_ps (bf16 pairs multiplied exactly, summed in float32) and each value row
// is widened to float32 by a 16-bit shift for the FMA into float32 sums; the result is rounded
// to bf16 once, to nearest even. AVX512 without BF16 runs bf16 through the portable loops. With
// AVX2 + FMA and no AVX-512 (TOKENLINE_AVX2) 8-lane intrinsics do the same arithmetic; without
// AVX2 a portable path does it in scalar code the compiler vectorizes. isa() names the path.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define TOKENLINE_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TOKENLINE_AVX512_BF16 1
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENLINE_AVX2 1
#endif

namespace {

constexpr int kTile = 16;  // rows scored together: one 16-lane vector of scores per head
// "no score yet": finite, since the file is built with -ffast-math (no infinities)
constexpr float kNoMax = -1e30f;

// bfloat16 is the top half of a float32: widening is exact, a shift.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (outputs are finite).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return bf16_to_float(h); }
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = float_to_bf16(x); }

// The running softmax of one query head over the rows seen so far.
struct Running {
  float* m;    // [Hq] max score
  float* l;    // [Hq] sum of e^(s - m)
  float* acc;  // [Hq * D] sum of e^(s - m) v
};

// Row j of a tile is the cache row at element offset off[j] (block and slot looked up once,
// shared by K and V and by every head).
inline void row_offsets(const int32_t* __restrict table, int64_t p0, int n, int64_t page,
                        int64_t row, int64_t* __restrict off) {
  for (int j = 0; j < n; ++j) {
    const int64_t p = p0 + j;
    off[j] = (static_cast<int64_t>(table[p / page]) * page + p % page) * row;
  }
}

// Prefetches of a list of cache rows into L2, issued a few lines at a time (`step`, once per
// row and head the caller reads) so that they spread over the work done until they are read: a
// burst of them would fill the core's miss buffers and stall it, and the memory would idle
// while it computes.
struct Ahead {
  const char* base = nullptr;
  const int64_t* off = nullptr;  // the rows, in elements of `size` bytes from base
  int64_t size = 0, row_bytes = 0;
  int rows = 0, per = 0;  // rows to prefetch, lines per step
  int row = 0;
  int64_t at = 0;  // the next line's offset in the current row

  Ahead() = default;
  // n rows of `bytes` each, spread over `steps` calls of step()
  Ahead(const void* b, const int64_t* o, int n, int64_t elem, int64_t bytes, int64_t steps)
      : base(static_cast<const char*>(b)), off(o), size(elem), row_bytes(bytes), rows(n) {
    steps = std::max<int64_t>(1, steps);
    per = static_cast<int>((n * ((bytes + 63) / 64) + steps - 1) / steps);
  }

  inline void step() {
    for (int i = 0; i < per && row < rows; ++i) {
      __builtin_prefetch(base + off[row] * size + at, 0, 2);  // prefetcht1: to L2
      if ((at += 64) >= row_bytes) at = 0, ++row;
    }
  }
};

// The G query heads that share one KV head. Portable: q widened to float32, plain loops for
// the compiler to vectorize.
template <typename T, int D, int G>
struct Heads {
  float q[G][D];

  void load(const T* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) q[g][d] = widen(src[g * head_stride + d]);
  }

  // s[g * ld + j] = scale * q_g . k_j for the n <= kTile rows k + off[j]
  void scores(const T* __restrict k, const int64_t* off, int n, float scale, float* s,
              int64_t ld, Ahead& pf) const {
    for (int j = 0; j < n; ++j) {
      pf.step();
      const T* __restrict kr = k + off[j];
      float dots[G];
      for (int g = 0; g < G; ++g) dots[g] = 0.f;
      for (int d = 0; d < D; ++d) {
        const float x = widen(kr[d]);
        for (int g = 0; g < G; ++g) dots[g] += q[g][d] * x;
      }
      for (int g = 0; g < G; ++g) s[g * ld + j] = dots[g] * scale;
    }
  }
};

// acc[g * D + d] += sum_j w[g * ld + j] v_j[d] over the n rows v + off[j] (portable)
template <typename T, int D, int G>
struct Values {
  static void add(const T* __restrict v, const int64_t* off, int n, const float* w, int64_t ld,
                  const float* shrink, float* __restrict acc, Ahead& pf) {
    for (int g = 0; g < G; ++g)
      if (shrink[g] != 1.f)
        for (int d = 0; d < D; ++d) acc[g * D + d] *= shrink[g];
    for (int j = 0; j < n; ++j) {
      pf.step();
      const T* __restrict vr = v + off[j];
      float vf[D];
      for (int d = 0; d < D; ++d) vf[d] = widen(vr[d]);
      for (int g = 0; g < G; ++g) {
        const float x = w[g * ld + j];
        for (int d = 0; d < D; ++d) acc[g * D + d] += x * vf[d];
      }
    }
  }
};

#ifdef TOKENLINE_AVX512

// lane j = the sum of v[j]'s 16 lanes: pairs, then quads within 128-bit lanes, then across
// lanes; 45 shuffles and adds for 16 dot products instead of 16 full reductions
inline __m512 sum_lanes16(const __m512 (&v)[kTile]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of rows 4i .. 4i+3
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __mmask16 first_lanes(int n) {
  return n >= kTile ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// Row j's products parts[g][j] summed and scaled into s[g * ld + j] (rows n.. are not stored)
template <int G>
inline void store_scores(__m512 (&parts)[G][kTile], int n, float scale, float* s, int64_t ld) {
  for (int g = 0; g < G; ++g) {
    for (int j = n; j < kTile; ++j) parts[g][j] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(s + g * ld, first_lanes(n),
                          _mm512_mul_ps(sum_lanes16(parts[g]), _mm512_set1_ps(scale)));
  }
}

template <int D, int G>
struct Heads<float, D, G> {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  static constexpr int C = D / 16;
  __m512 q[G][C];

  void load(const float* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(src + g * head_stride + c * 16);
  }

  void scores(const float* __restrict k, const int64_t* off, int n, float scale, float* s,
              int64_t ld, Ahead& pf) const {
    __m512 parts[G][kTile];
    for (int j = 0; j < n; ++j) {
      pf.step();
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(k + off[j] + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(q[g][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(q[g][c], kv[c], a);
        parts[g][j] = a;
      }
    }
    store_scores<G>(parts, n, scale, s, ld);
  }
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 bf16 widened to float32
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 and bfloat16 values alike: the sums of all G heads stay in registers over the rows
template <typename T, int D, int G>
inline void add_values512(const T* __restrict v, const int64_t* off, int n, const float* w,
                          int64_t ld, const float* shrink, float* __restrict out, Ahead& pf) {
  constexpr int V = D / 16;
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c)
      acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(out + g * D + c * 16), _mm512_set1_ps(shrink[g]));
  for (int j = 0; j < n; ++j) {
    pf.step();
    for (int c = 0; c < V; ++c) {
      const __m512 x = load16(v + off[j] + c * 16);
      for (int g = 0; g < G; ++g)
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * ld + j]), x, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + g * D + c * 16, acc[g][c]);
}

template <int D, int G>
struct Values<float, D, G> {
  static void add(const float* v, const int64_t* off, int n, const float* w, int64_t ld,
                  const float* shrink, float* acc, Ahead& pf) {
    add_values512<float, D, G>(v, off, n, w, ld, shrink, acc, pf);
  }
};

#endif  // TOKENLINE_AVX512

#ifdef TOKENLINE_AVX2

// AVX2 + FMA without AVX-512 (Zen 2/3 EPYCs, older Xeons): 8-lane vectors, bfloat16 widened to
// float32 by a shift as it is loaded. The compiler's own vectorization of the portable loops
// ran at a third of these (a dot product's horizontal sum per row and head, bf16 widened
// element by element): decode attention at 4k context read 4-6 GB/s of KV on a 2-core Zen 3,
// against 12-20 GB/s that a plain read of the same bytes gets.

using tokenline::load8;  // cpu_vec.h

// lane j = the sum of v[j]'s 8 lanes (sums of lanes 0-3 and of 4-7 by hadds, then the halves)
inline __m256 sum_lanes8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

using tokenline::exp8;  // cpu_vec.h

// lanes j < n all ones (8 - n lanes past a tile's end)
inline __m256 live8(int n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota));
}

// The G query heads of one KV head, q widened to float32. A tile's rows are scored R at a time
// for every head at once: each key vector is loaded once and multiplied into the G heads' sums
// (G * R of them in registers, q an FMA's memory operand from L1), then each head's R sums are
// reduced across lanes by one hadd tree. bfloat16 keys are widened into a float32 copy of the
// tile first, once, not once per head. Measured on an AVX2 EPYC (Zen 3) against scoring 8 rows
// for one head at a time (each key vector loaded once per head, stored through a masked store,
// which Zen microcodes): bfloat16 3-10% faster at decode64 and 4k contexts, float32 the
// same (docs/benchmarks.md).
template <typename T, int D, int G>
struct Heads2 {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  static constexpr int C = D / 8;  // vectors of a row
  static constexpr int R = G == 1 ? 8 : G <= 3 ? 4 : G <= 7 ? 2 : 1;  // G * R sums <= 14
  alignas(32) float q[G][D];

  void load(const T* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) q[g][d] = widen(src[g * head_stride + d]);
  }

  // s[g * ld + r] = scale * q_g . row[r] for r < R
  void group(const float* const (&row)[R], float scale, float* s, int64_t ld) const {
    __m256 a[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) a[g][r] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) {
        const __m256 k = _mm256_loadu_ps(row[r] + c * 8);
        for (int g = 0; g < G; ++g)
          a[g][r] = _mm256_fmadd_ps(_mm256_load_ps(q[g] + c * 8), k, a[g][r]);
      }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < G; ++g) {
      if constexpr (R == 8) {
        _mm256_storeu_ps(s + g * ld, _mm256_mul_ps(sum_lanes8(a[g]), sc));
      } else {
        // per 128-bit lane: the R rows' partial sums in lanes 0..R-1; then the two halves
        __m256 h;
        if constexpr (R == 4)
          h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
        else if constexpr (R == 2)
          h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_setzero_ps());
        else
          h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][0]), _mm256_setzero_ps());
        const __m128 x = _mm_mul_ps(
            _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
            _mm256_castps256_ps128(sc));
        if constexpr (R == 4) _mm_storeu_ps(s + g * ld, x);
        else if constexpr (R == 2) _mm_storel_pi(reinterpret_cast<__m64*>(s + g * ld), x);
        else _mm_store_ss(s + g * ld, x);
      }
    }
  }

  void scores(const T* __restrict k, const int64_t* off, int n, float scale, float* s,
              int64_t ld, Ahead& pf) const {
    constexpr bool wide = std::is_same<T, float>::value;
    alignas(32) float kf[wide ? 1 : kTile][D];  // bf16: the tile's keys in float32
    for (int j = 0; j < n; ++j) {
      pf.step();
      if constexpr (!wide)
        for (int c = 0; c < C; ++c) _mm256_store_ps(kf[j] + c * 8, load8(k + off[j] + c * 8));
    }
    for (int j0 = 0; j0 < n; j0 += R) {
      const int m = std::min(R, n - j0);
      const float* row[R];  // rows past the tile's end repeat its last (their sums unused)
      for (int r = 0; r < R; ++r) {
        const int j = j0 + std::min(r, m - 1);
        if constexpr (wide) row[r] = reinterpret_cast<const float*>(k + off[j]);
        else row[r] = kf[j];
      }
      group(row, scale, s + j0, ld);
    }
  }
};

template <int D, int G>
struct Heads<float, D, G> : Heads2<float, D, G> {};
template <int D, int G>
struct Heads<uint16_t, D, G> : Heads2<uint16_t, D, G> {};

// The largest divisor h of V (vectors of a row) whose G * h sums, G weights and a value fit
// the 16 registers.
constexpr int chunk_vectors(int V, int G) {
  int h = 1;
  for (int d = 1; d <= V; ++d)
    if (V % d == 0 && G * d + G + 1 <= 16) h = d;
  return h;
}

// acc[g * D + d] = shrink[g] acc[g * D + d] + sum_j w[g * ld + j] v_j[d]: H vectors of the
// row at a time, the sums of every head in registers over all n rows
template <typename T, int D, int G>
struct Values2 {
  static void add(const T* __restrict v, const int64_t* off, int n, const float* w, int64_t ld,
                  const float* shrink, float* __restrict acc, Ahead& pf) {
    constexpr int V = D / 8, H = chunk_vectors(V, G);
    for (int c0 = 0; c0 < V; c0 += H) {
      __m256 a[G][H];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < H; ++c)
          a[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + (c0 + c) * 8),
                                  _mm256_set1_ps(shrink[g]));
      for (int j = 0; j < n; ++j) {
        if (c0 == 0) pf.step();
        __m256 wj[G];
        for (int g = 0; g < G; ++g) wj[g] = _mm256_broadcast_ss(w + g * ld + j);
        for (int c = 0; c < H; ++c) {
          const __m256 x = load8(v + off[j] + (c0 + c) * 8);
          for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(wj[g], x, a[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < H; ++c) _mm256_storeu_ps(acc + g * D + (c0 + c) * 8, a[g][c]);
    }
  }
};

template <int D, int G>
struct Values<float, D, G> : Values2<float, D, G> {};
template <int D, int G>
struct Values<uint16_t, D, G> : Values2<uint16_t, D, G> {};

#endif  // TOKENLINE_AVX2

#ifdef TOKENLINE_AVX512_BF16

// 32 bf16 of a row from element d on (zeros past D: they add nothing to a dot product)
template <int D>
inline __m512bh load_pairs(const uint16_t* p, int d) {
  const __mmask32 m = D - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p + d));
}

template <int D, int G>
struct Heads<uint16_t, D, G> {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  static constexpr int C = (D + 31) / 32;  // 32-wide chunks of a row for the dots
  __m512bh q[G][C];

  void load(const uint16_t* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) q[g][c] = load_pairs<D>(src + g * head_stride, c * 32);
  }

  void scores(const uint16_t* __restrict k, const int64_t* off, int n, float scale, float* s,
              int64_t ld, Ahead& pf) const {
    __m512 parts[G][kTile];
    for (int j = 0; j < n; ++j) {
      pf.step();
      __m512bh kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_pairs<D>(k + off[j], c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, q[g][c], kv[c]);
        parts[g][j] = a;
      }
    }
    store_scores<G>(parts, n, scale, s, ld);
  }
};

template <int D, int G>
struct Values<uint16_t, D, G> {
  static void add(const uint16_t* v, const int64_t* off, int n, const float* w, int64_t ld,
                  const float* shrink, float* acc, Ahead& pf) {
    add_values512<uint16_t, D, G>(v, off, n, w, ld, shrink, acc, pf);
  }
};

constexpr bool kFastBf16 = true;
#else
constexpr bool kFastBf16 = false;
#endif  // TOKENLINE_AVX512_BF16

// The largest of a tile's n scores.
inline float tile_max(const float* s, int n) {
#if defined(TOKENLINE_AVX512)
  return _mm512_mask_reduce_max_ps(first_lanes(n), _mm512_loadu_ps(s));
#elif defined(TOKENLINE_AVX2)
  const __m256 none = _mm256_set1_ps(kNoMax);
  __m256 v = _mm256_max_ps(_mm256_blendv_ps(none, _mm256_loadu_ps(s), live8(n)),
                           _mm256_blendv_ps(none, _mm256_loadu_ps(s + 8), live8(n - 8)));
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_cvtss_f32(v);
#else
  float mx = kNoMax;
  for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
#endif
}

// s[j] = e^(s[j] - mx) for the tile's n scores; returns their sum.
inline float tile_exp(float* __restrict s, int n, float mx) {
#if defined(TOKENLINE_AVX512)
  const __mmask16 live = first_lanes(n);
  const __m512 e =
      tokenline::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s), _mm512_set1_ps(mx)));
  _mm512_mask_storeu_ps(s, live, e);
  return _mm512_reduce_add_ps(_mm512_maskz_mov_ps(live, e));
#elif defined(TOKENLINE_AVX2)
  // lanes past n: whatever they held, weight 0 (they are never read as weights)
  const __m256 m = _mm256_set1_ps(mx);
  const __m256 lo = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s), m)), live8(n));
  const __m256 hi = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8), m)), live8(n - 8));
  _mm256_storeu_ps(s, lo);
  _mm256_storeu_ps(s + 8, hi);
  __m256 v = _mm256_add_ps(lo, hi);
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_hadd_ps(v, v);
  return _mm256_cvtss_f32(_mm256_hadd_ps(v, v));
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // a vector exp (libmvec)
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return sum;
#endif
}

// Folds one head's scores s[0..n) of a tile into its running max m and sum l: s becomes the
// weights e^(s - m); returned is the factor e^(m_old - m) by which its sum of values must
// shrink (the max rose).
inline float fold_scores(float* __restrict s, int n, float& m, float& l) {
  const float mx = std::max(m, tile_max(s, n));
  const float shrink = mx == m ? 1.f : m == kNoMax ? 0.f : std::exp(m - mx);
  l = l * shrink + tile_exp(s, n, mx);
  m = mx;
  return shrink;
}

// Where a core reads next once this piece is done: the first tile of the piece it took next
// (null table: none).
struct Span {
  const int32_t* table;
  int64_t t0, t1;
};

// Positions [t0, t1) of one request, every head, folded into `r` (the request's Hq heads, kv
// head h's G of them at r.m + h * G, ...), a tile of up to 16 positions at a time: the tile's
// keys scored for every head, one softmax fold per query head, then the tile's values; `s` is
// room for Hq * (kTile + 1) floats.
//
// Blocks sit anywhere in the pool, so neither the hardware prefetcher (which stops at 4 KiB
// pages and needs a few misses to start) nor out-of-order execution has the next rows in
// time. So while a tile's keys are scored the next tile's key rows are prefetched (the next
// piece's first, after the last), and while its values are summed the next tile's value rows:
// each row asked for one tile ahead of its use, into L2, a few lines per row read (`Ahead`).
// Measured with bench/decode_attention.py (30 layers of SmolLM2's batch-64 step, both threads,
// huge pages as the scheduler runs): on a 2-core Zen 4 EPYC, against the rows asked for half a
// tile ahead into L1 (this kernel's earlier choice, tuned on a Zen 5 EPYC), float32 29.9
// against 39.3 ms contiguous and 30.7 against 41.1 shuffled, bfloat16 19.5 against 22.9 and
// 22.2 against 28.6; the next block prefetched in one burst, two tiles ahead, and the next
// tile's values prefetched to L1 as well all measured slower or no faster; tiles of 32-128
// positions measured slower on the Zen 5.
template <typename T, int D, int G>
void attend_piece(const T* q, int64_t q_head_stride, const T* kc, const T* vc,
                  const int32_t* table, int64_t t0, int64_t t1, int64_t page, int64_t Hkv,
                  float scale, const Running& r, float* s, Span next) {
  const int64_t row = Hkv * D, Hq = Hkv * G;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  float* shrink = s + Hq * kTile;  // [Hq] each head's factor for its sum of values
  alignas(64) int64_t off[kTile], coming[kTile];
  for (int64_t j = t0; j < t1; j += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, t1 - j));
    row_offsets(table, j, n, page, row, off);
    const bool last = j + kTile >= t1;
    const int32_t* nt = last ? next.table : table;
    const int64_t n0 = last ? next.t0 : j + kTile, n1 = last ? next.t1 : t1;
    const int nc = nt ? static_cast<int>(std::min<int64_t>(kTile, n1 - n0)) : 0;
    row_offsets(nt, n0, nc, page, row, coming);
    Ahead keys_ahead(kc, coming, nc, sizeof(T), row_bytes, n * Hkv);
    for (int64_t h = 0; h < Hkv; ++h) {
      Heads<T, D, G> heads;  // reloaded per tile: from L1, and it leaves the registers free
      heads.load(q + h * G * q_head_stride, q_head_stride);
      heads.scores(kc + h * D, off, n, scale, s + h * G * kTile, kTile, keys_ahead);
    }
    for (int64_t hq = 0; hq < Hq; ++hq)
      shrink[hq] = fold_scores(s + hq * kTile, n, r.m[hq], r.l[hq]);
    Ahead values_ahead(vc, coming, nc, sizeof(T), row_bytes, n * Hkv);
    for (int64_t h = 0; h < Hkv; ++h)
      Values<T, D, G>::add(vc + h * D, off, n, s + h * G * kTile, kTile, shrink + h * G,
                           r.acc + h * G * D, values_ahead);
  }
}

template <typename T>
using PieceFn = void (*)(const T*, int64_t, const T*, const T*, const int32_t*, int64_t,
                         int64_t, int64_t, int64_t, float, const Running&, float*, Span);

template <typename T, int D>
PieceFn<T> pick_group(int64_t G) {
  switch (G) {
    case 1: return attend_piece<T, D, 1>;
    case 2: return attend_piece<T, D, 2>;
    case 3: return attend_piece<T, D, 3>;
    case 4: return attend_piece<T, D, 4>;
    case 5: return attend_piece<T, D, 5>;
    case 6: return attend_piece<T, D, 6>;
    case 7: return attend_piece<T, D, 7>;
    case 8: return attend_piece<T, D, 8>;
    default: return nullptr;
  }
}

template <typename T>
PieceFn<T> pick(int64_t D, int64_t G) {
  switch (D) {
    case 32: return pick_group<T, 32>(G);
    case 64: return pick_group<T, 64>(G);
    case 80: return pick_group<T, 80>(G);
    case 96: return pick_group<T, 96>(G);
    case 128: return pick_group<T, 128>(G);
    case 256: return pick_group<T, 256>(G);  // Gemma 3
    default: return nullptr;
  }
}

struct Piece {
  int64_t n;       // decode row
  int64_t t0, t1;  // positions
  int64_t part;    // its slot among the partial results, or -1: the row's only piece
};

// A piece spans at least this many positions: below it, the merge and the per-piece setup cost
// more than the balance they buy.
constexpr int64_t kMinPiece = 64;

// K and V bytes below which a step runs on one thread. Under OMP_WAIT_POLICY=PASSIVE (which
// every bench module sets) a waiting OpenMP thread sleeps at once, and waking it costs 15-20 us,
// more than a batch-1 step at a context of 256 takes on one core: 1 MiB (SmolLM2's 680 float32
// positions, 1,365 bfloat16; split over two cores, 1,024 float32 positions were about even).
// Under libgomp's default (the server's) or ACTIVE the pool's threads are still spinning from
// the step's last parallel call (a projection's) and start at once: 16 KiB (an AVX2 EPYC, 30
// layers of SmolLM2 at batch 1, float32, ms a step: 256 positions 0.71 against 0.88 on one
// thread, 640 positions 1.99 against 2.92, 64 the same).
int64_t serial_bytes() {
  static const int64_t bytes = [] {
    std::string policy = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "";
    for (char& c : policy) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return policy == "passive" ? int64_t{1} << 20 : int64_t{1} << 14;
  }();
  return bytes;
}

struct Step {
  int64_t N, Hq, Hkv, D, page, W;
  int64_t q_s0, q_s1;  // q's strides (rows, heads)
  float scale;
  int64_t window;
  const int32_t* tables;
  const int32_t* lens;
  const int64_t* rows;    // null: row n is request n
  const int64_t* tokens;  // null: row n is token n
};

template <typename T>
void write_out(T* o, const float* acc, const float* l, int64_t Hq, int64_t D) {
  for (int64_t h = 0; h < Hq; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t d = 0; d < D; ++d) put(o + h * D + d, acc[h * D + d] * inv);
  }
}

template <typename T>
void attend(const Step& s, const T* q, const T* kc, const T* vc, T* out, PieceFn<T> fn) {
  const int64_t Hq = s.Hq, D = s.D;
  auto request = [&](int64_t n) { return s.rows ? s.rows[n] : n; };
  auto token = [&](int64_t n) { return s.tokens ? s.tokens[n] : n; };
  auto first = [&](int64_t n) {
    const int64_t len = s.lens[request(n)];
    return s.window > 0 ? std::max<int64_t>(0, len - s.window) : int64_t{0};
  };
  int64_t total = 0;
  for (int64_t n = 0; n < s.N; ++n) total += s.lens[request(n)] - first(n);
  // A small step runs on the calling thread (serial_bytes: where waking the pool costs more
  // than the split gains)
  const bool small = total * s.Hkv * D * static_cast<int64_t>(sizeof(T)) * 2 < serial_bytes();
  const int threads = small ? 1 : at::get_num_threads();
  // about four pieces per core in all, whole blocks each, none shorter than kMinPiece (one
  // core: one piece a request, nothing to merge)
  int64_t piece = threads <= 1 ? std::numeric_limits<int64_t>::max() / 2
                               : std::max<int64_t>(kMinPiece, (total + 4 * threads - 1) /
                                                                   (4 * threads));
  piece = (piece + s.page - 1) / s.page * s.page;
  std::vector<Piece> pieces;
  std::vector<int64_t> part0(s.N), parts(s.N);
  int64_t num_parts = 0;
  for (int64_t n = 0; n < s.N; ++n) {
    const int64_t t0 = first(n), len = s.lens[request(n)];
    // cut at multiples of `piece`, so pieces start on block boundaries
    const int64_t cuts = (len - 1) / piece - t0 / piece;
    part0[n] = num_parts;
    parts[n] = cuts > 0 ? cuts + 1 : 0;
    int64_t a = t0;
    for (int64_t i = 0; i <= cuts; ++i) {
      const int64_t b = std::min(len, (t0 / piece + i + 1) * piece);
      pieces.push_back({n, a, b, cuts > 0 ? num_parts++ : -1});
      a = b;
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.t1 - a.t0 > b.t1 - b.t0;
  });
  const int64_t stride = Hq * (D + 2);  // a partial result: acc [Hq * D], m [Hq], l [Hq]
  std::vector<float> partial(static_cast<size_t>(num_parts * stride));
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[s.N]);
  for (int64_t n = 0; n < s.N; ++n) left[n].store(parts[n], std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(pieces.size());

  auto merge = [&](int64_t n) {
    std::vector<float> acc(Hq * D, 0.f), l(Hq, 0.f);
    for (int64_t h = 0; h < Hq; ++h) {
      float mx = kNoMax;
      for (int64_t p = part0[n]; p < part0[n] + parts[n]; ++p)
        mx = std::max(mx, partial[p * stride + Hq * D + h]);
      for (int64_t p = part0[n]; p < part0[n] + parts[n]; ++p) {
        const float* base = partial.data() + p * stride;
        const float w = std::exp(base[Hq * D + h] - mx);
        l[h] += base[Hq * D + Hq + h] * w;
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] += base[h * D + d] * w;
      }
    }
    write_out(out + token(n) * Hq * D, acc.data(), l.data(), Hq, D);
  };

  auto table = [&](const Piece& pc) { return s.tables + request(pc.n) * s.W; };
  // a core claims its next piece when it starts one, so that it can prefetch that piece's
  // first keys while it finishes this one
  auto work = [&](int64_t, int64_t) {
    std::vector<float> mine(static_cast<size_t>(stride));
    std::vector<float> scores(static_cast<size_t>(Hq * (kTile + 1)));
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < count) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      const Piece& pc = pieces[i];
      const Span coming = after < count ? Span{table(pieces[after]), pieces[after].t0,
                                               pieces[after].t1}
                                        : Span{nullptr, 0, 0};
      float* base = pc.part < 0 ? mine.data() : partial.data() + pc.part * stride;
      const Running r{base + Hq * D, base + Hq * D + Hq, base};
      std::fill(r.acc, r.acc + Hq * D, 0.f);
      std::fill(r.m, r.m + Hq, kNoMax);
      std::fill(r.l, r.l + Hq, 0.f);
      fn(q + token(pc.n) * s.q_s0, s.q_s1, kc, vc, table(pc), pc.t0, pc.t1, s.page, s.Hkv,
         s.scale, r, scores.data(), coming);
      if (pc.part < 0)
        write_out(out + token(pc.n) * Hq * D, r.acc, r.l, Hq, D);
      else if (left[pc.n].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge(pc.n);  // the row's last piece: every other one is in `partial` by now
      i = after;
    }
  };
  if (count <= 1 || threads <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, threads, 1, work);
  }
}

// The step's new K/V rows into their cache slots (k, v: [T, Hkv, D], rows of any stride).
template <typename T>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = src.size(0), Hkv = src.size(1), D = src.size(2);
  const T* sp = reinterpret_cast<const T*>(src.data_ptr());
  T* cp = reinterpret_cast<T*>(cache.data_ptr());
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < Hkv; ++h)
      std::memcpy(cp + (slots[t] * Hkv + h) * D, sp + t * s0 + h * s1, D * sizeof(T));
}

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
              v_cache.scalar_type() == dtype, "paged decode: caches all float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              k_cache.sizes() == v_cache.sizes(), "paged decode: contiguous [S, Hkv, D] caches");
}

}  // namespace

bool supports(int64_t head_dim, int64_t group) {
  return pick<float>(head_dim, group) != nullptr && pick<uint16_t>(head_dim, group) != nullptr;
}

// Whether the bfloat16 kernel was built with AVX512-BF16 (else it is the portable one).
bool fast_bf16() { return kFastBf16; }

// The vector path this build runs (-march=native picks it at build time): the start-up log
// names it.
std::string isa() {
#if defined(TOKENLINE_AVX512_BF16)
  return "avx512_bf16";
#elif defined(TOKENLINE_AVX512)
  return "avx512";
#elif defined(TOKENLINE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache,
              torch::Tensor v_cache, const torch::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() &&
              v.scalar_type() == k_cache.scalar_type(), "write_kv: k, v in the cache's dtype");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(1) &&
              k.size(2) == k_cache.size(2) && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv: k, v [T, Hkv, D] with unit stride over D");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "write_kv: int64 slot_mapping [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "write_kv: slot ", slots[t], " out of range");
  if (k_cache.scalar_type() == torch::kFloat32) {
    write_rows<float>(k, k_cache, slots);
    write_rows<float>(v, v_cache, slots);
  } else {
    write_rows<uint16_t>(k, k_cache, slots);
    write_rows<uint16_t>(v, v_cache, slots);
  }
}

torch::Tensor decode(const torch::Tensor& q, torch::Tensor k_cache, torch::Tensor v_cache,
                     const torch::Tensor& tables, const torch::Tensor& seq_lens,
                     int64_t page_size, double scale, int64_t window,
                     const std::optional<torch::Tensor>& k,
                     const std::optional<torch::Tensor>& v,
                     const std::optional<torch::Tensor>& slot_mapping,
                     const std::optional<torch::Tensor>& rows,
                     const std::optional<torch::Tensor>& tokens,
                     const std::optional<torch::Tensor>& out) {
  check_cache(k_cache, v_cache);
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == dtype && q.dim() == 3 && q.stride(2) == 1,
              "paged decode: q [T, Hq, D] in the cache's dtype, unit stride over D");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && tables.is_contiguous() &&
              seq_lens.dtype() == torch::kInt32 && seq_lens.is_contiguous(),
              "paged decode: contiguous int32 tables and seq_lens");
  TORCH_CHECK(rows.has_value() == tokens.has_value(), "paged decode: rows and tokens together");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && Hq % Hkv == 0 &&
              pick<float>(D, Hq / Hkv) != nullptr,
              "paged decode: unsupported head size or group");
  if (k.has_value()) {
    TORCH_CHECK(v.has_value() && slot_mapping.has_value(), "paged decode: k, v and slots");
    write_kv(*k, *v, k_cache, v_cache, *slot_mapping);
  }
  const int64_t N = rows ? rows->numel() : q.size(0);
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->is_contiguous() &&
                tokens->scalar_type() == torch::kInt64 && tokens->is_contiguous() &&
                tokens->numel() == N, "paged decode: int64 rows and tokens [N]");
  } else {
    TORCH_CHECK(seq_lens.numel() == N, "paged decode: one request per q row");
  }
  torch::Tensor result = out ? *out : torch::empty({q.size(0), Hq, D}, q.options());
  TORCH_CHECK(result.is_contiguous() && result.scalar_type() == dtype &&
              result.size(0) == q.size(0) && result.size(1) == Hq && result.size(2) == D,
              "paged decode: out [T, Hq, D], contiguous, in q's dtype");
  Step s{N, Hq, Hkv, D, page_size, tables.size(1), q.stride(0), q.stride(1),
         static_cast<float>(scale), window, tables.data_ptr<int32_t>(),
         seq_lens.data_ptr<int32_t>(), rows ? rows->data_ptr<int64_t>() : nullptr,
         tokens ? tokens->data_ptr<int64_t>() : nullptr};
  if (dtype == torch::kFloat32) {
    attend<float>(s, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  result.data_ptr<float>(), pick<float>(D, Hq / Hkv));
  } else {
    auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    attend<uint16_t>(s, bits(q), bits(k_cache), bits(v_cache), bits(result),
                     pick<uint16_t>(D, Hq / Hkv));
  }
  return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode,
        "write the step's K/V rows (optional) and attend every decode row over the paged KV "
        "cache (float32 or bfloat16, CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"),
        py::arg("seq_lens"), py::arg("page_size"), py::arg("scale"), py::arg("window"),
        py::arg("k") = py::none(), py::arg("v") = py::none(),
        py::arg("slot_mapping") = py::none(), py::arg("rows") = py::none(),
        py::arg("tokens") = py::none(), py::arg("out") = py::none());
  m.def("write_kv", &write_kv, "the step's new K/V rows into their cache slots");
  m.def("supports", &supports, "whether a head size and GQA group size are compiled in");
  m.def("fast_bf16", &fast_bf16, "whether the bfloat16 kernel uses AVX512-BF16");
  m.def("isa", &isa, "the vector path built: avx512_bf16, avx512, avx2 or portable");
}
