// Weight-only int8 and int4 matmuls on CPU, and float32 ones from the same tiles: float32
// activations in and out, float32 sums.
//
//   out[m, n] = sum_k x[m, k] * w[n, k]
//
// Weights are stored in tiles of 16 output channels, interleaved per k, so one 16-byte load
// gives one k of 16 channels: one vector of codes then feeds every batch row of a block held in
// registers (up to 8 rows of accumulators). Below 16 rows the weights are never dequantized in
// memory (batch 1 reads 1 or 0.5 bytes a weight, plus scales); below 4 rows the scale and
// minimum are applied once per group of 32 rather than per weight (quant_tile). From 16 rows
// each group of three tiles is dequantized once per call into float32 buffers and every row
// runs from there, each broadcast activation feeding the three (run_groups).
//
//   int8  q   [T, Kp, 16] uint8        code of channel 16t + c at k: q[t, k, c]
//   int4  q   [T, Kp/2, 16] uint8      byte (t, j, c) holds k = 2j (low nibble), 2j + 1 (high)
//   both  sm  [T, G, 2, 16] half|float w = sm[t, k / 32, 0, c] * code + sm[t, k / 32, 1, c]
//         (a scale and a minimum per 32 values: GGUF Q8_0 is scale d, minimum -128 d with
//         codes q + 128; Q4_0, Q4_1 and Q4_K's sub-blocks map as quant.py says)
//   float w   [T, K, 16] float        weight of channel 16t + c at k: w[t, k, c]
//   x [M, Kp] float32 (Kp = 32 G: the caller pads K), out [M, N] float32, T = ceil(N / 16).
//
// float32 tiles need no dequantizing: every call, from one row, runs run_groups straight from
// the weights (float_linear), the register blocks the int8 path runs from its buffers.
// bfloat16 tiles (bf16_linear, built where the CPU has AVX512-BF16) hold k in pairs,
//   bf16  w   [T, K/2, 16, 2]          weight of channel 16t + c at k: w[t, k / 2, c, k % 2]
// and run the same groups and blocks with bfloat16 activations in and out.
//
// The dequantized weight is what the reference computes: code * scale + min is one FMA, and
// with a half scale the product is exact in float32 (8 + 11 bits), so the reference's single
// rounding when it adds min gives the same number. From 4 rows only the order of the K-sum
// differs from a dequantize-then-matmul reference; below 4 rows the sum is regrouped as
// scale * sum(code x) + min * sum(x) per group. Either way the two agree within float32
// summation error of sum_k |x_k| (|scale code_k| + |min|) (tests/unit/test_quant.py).
//
// With AVX512F (the build is -march=native) the tiles run in intrinsics. An AVX2 build runs
// 1-3 rows in the factored form and from 4 rows dequantizes each call's tiles, both in AVX2
// intrinsics; without AVX2 and FMA, the same loops in plain C++.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;   // output channels per tile
constexpr int64_t GROUP = 32;   // k values per scale
// below this many rows quant_tile takes the scale and minimum out of the k loop
constexpr int64_t FACTORED_ROWS = 4;
// from this many rows tiles are dequantized into float32 once per call (run_groups). An
// AVX2 build (no AVX-512) does from 4 rows: its quant_tile from 4 rows is the plain loops,
// which the compiler leaves 5-15x slower than oneDNN's float32 (batch 64: 3.8 s against 0.27 s
// a SmolLM2 step's matmuls, an AVX2 EPYC), while dequantizing into L1 and running the FMAs in
// intrinsics (float_tiles below) reads the codes once and keeps both FMA units busy. Below 4
// rows it runs the factored form in intrinsics (avx2_factored_tile): dequantizing every call
// there took an int4 batch-1 step's matmuls 19.7 ms, 5.6x their memory bound.
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
constexpr int64_t DEQUANT_ROWS = 16;
#else
constexpr int64_t DEQUANT_ROWS = FACTORED_ROWS;
#endif
// With 1-3 rows a call is a stream of weight bytes with one or two FMAs per code. Where one
// core streams near what both do (a Zen-5 class EPYC here: 35-39 GB/s against 44, with the
// prefetches below), a second thread adds little bandwidth, and waking it (the passive OpenMP
// wait policy, a futex) costs microseconds in each of a step's 121 calls: there one thread ran
// a batch-1 step's matmuls in int8 3.9-4.6 ms, int4 2.8-3.2, against two threads' 5.2 / 4.1.
// Where one core streams far less than two (a Xeon VM here: 9 against 13.4 GB/s) the second
// thread wins by a third. So calls of 1-3 rows up to `one_thread_bytes` weight bytes (rows x
// bytes: SmolLM2's int8 lm_head is 31 MB) run on the calling thread, and the Python side
// measures both on the loaded model's weights and sets the limit (0: never one thread; see
// quant.calibrate_small_calls).
constexpr int64_t ONE_THREAD_BYTES_DEFAULT = int64_t{64} << 20;
std::atomic<int64_t> one_thread_bytes{ONE_THREAD_BYTES_DEFAULT};

// Weight bytes [p, end) to ask for while a block of rows runs from the buffers (the next tile
// group's codes, in DRAM when the layer is not in cache), `per_step` cache lines per 4 k.
struct Ahead {
  const char* p;
  const char* end;
  int64_t per_step;
};

#if defined(__AVX512F__) || defined(__AVX2__)

// The codes and scales of the group this many groups ahead are asked for into L1 while one
// computes: 32 KiB of int8 codes (P = 1 k per 16-byte row), 8 KiB of int4 (P = 2). A thread
// walks its tiles' bytes in one ascending stream, but the hardware prefetchers stop at each
// 4 KiB page and ramp up again after a few misses: at batch 1, where a step's weights come
// from DRAM and each call reads only 0.1-1 MB, that left the kernels at 14-18 GB/s against
// the machine's 44 (bench.quant_kernels --from-memory). Reading past the thread's last tile
// only warms bytes nobody uses; a prefetch never faults.
constexpr int64_t prefetch_groups(int P) { return P == 1 ? 64 : 32; }

template <int P, typename S>
inline void prefetch_group(const uint8_t* qg, const S* smg) {
  constexpr int64_t QBYTES = GROUP / P * LANES;  // one group of a tile's codes
  constexpr int64_t SBYTES = 2 * LANES * sizeof(S);  // its scales and minimums
  const char* q_ahead = reinterpret_cast<const char*>(qg + prefetch_groups(P) * QBYTES);
  const char* s_ahead = reinterpret_cast<const char*>(smg + prefetch_groups(P) * 2 * LANES);
  for (int64_t b = 0; b < QBYTES; b += 64) _mm_prefetch(q_ahead + b, _MM_HINT_T0);
  for (int64_t b = 0; b < SBYTES; b += 64) _mm_prefetch(s_ahead + b, _MM_HINT_T0);
}

#endif

#ifdef __AVX512F__

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Independent accumulators per row: an FMA's result is ready only ~4 cycles later, so with
// fewer than 4 rows the k loop alternates between U chains to keep the FMA units busy.
template <int R>
constexpr int chains() { return R >= 4 ? 1 : 4 / R; }

template <int R>
inline void store_rows(__m512 (&acc)[R][chains<R>()], float* out, int64_t ldo, int valid) {
  const __mmask16 mask = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
    for (int u = 1; u < chains<R>(); ++u) sum = _mm512_add_ps(sum, acc[r][u]);
    _mm512_mask_storeu_ps(out + r * ldo, mask, sum);
  }
}

// How a tile's codes are read: one 16-byte row of a tile holds PER_ROW consecutive k of its
// 16 channels (int8: one k; int4: k = 2j in the low nibbles, 2j + 1 in the high ones), as
// float32 vectors of codes.
struct Int8Codes {
  static constexpr int PER_ROW = 1;
  static void read(const uint8_t* row, __m512 (&c)[PER_ROW]) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
  }
};

struct Int4Codes {
  static constexpr int PER_ROW = 2;
  static void read(const uint8_t* row, __m512 (&c)[PER_ROW]) {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    c[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    c[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};

// R rows of x against one tile of codes C: out[r, 0..valid) for the tile's 16 channels.
//
// Below 4 rows the scale and minimum come out of the k loop: per group,
//   sum_k w_k x_k = scale * sum_k code_k x_k + minimum * sum_k x_k
// (xsum [G][R] holds each row's sum_k x_k per group), one FMA per code and row instead of two
// (the dequantizing one is shared by only R rows); codes are small integers, exact in float32.
// From 4 rows the dequantizing FMA is a small part and folding per group would cost more.
template <typename C, int R, typename S>
void quant_tile(const float* x, const float* xsum, const uint8_t* q, const S* sm, int64_t G,
                float* out, int64_t ldo, int valid) {
  constexpr int U = chains<R>();
  constexpr int P = C::PER_ROW;
  constexpr bool FACTORED = R < FACTORED_ROWS;
  __m512 acc[R][U], part[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = load16(sm + g * 2 * LANES);
    const __m512 m = load16(sm + g * 2 * LANES + LANES);
    const uint8_t* qg = q + g * (GROUP / P) * LANES;
    const float* xg = x + g * GROUP * R;
    prefetch_group<P>(qg, sm + g * 2 * LANES);
    if constexpr (FACTORED)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) part[r][u] = _mm512_setzero_ps();
    auto& sum = FACTORED ? part : acc;
#pragma GCC unroll 32
    for (int j = 0; j < GROUP / P; ++j) {
      __m512 c[P];
      C::read(qg + j * LANES, c);
#pragma GCC unroll 2
      for (int i = 0; i < P; ++i) {
        const int k = j * P + i;
        const __m512 w = FACTORED ? c[i] : _mm512_fmadd_ps(c[i], s, m);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          sum[r][k % U] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[k * R + r]), sum[r][k % U]);
      }
    }
    if constexpr (FACTORED)
      for (int r = 0; r < R; ++r) {
        __m512 p = part[r][0];
        for (int u = 1; u < U; ++u) p = _mm512_add_ps(p, part[r][u]);
        acc[r][g % U] = _mm512_fmadd_ps(s, p, acc[r][g % U]);
        acc[r][g % U] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[g * R + r]), acc[r][g % U]);
      }
  }
  store_rows<R>(acc, out, ldo, valid);
}

// Large batches: a tile is dequantized once into a float32 buffer w [Kp][16] (the numbers the
// tiles above compute in registers) and every row block then runs from it: no conversions in
// the inner loop, and three tiles share each activation (float_tiles). Measured at batch 64
// (1 thread): 5-12% faster than dequantizing in registers.
template <typename C, typename S>
void dequant(const uint8_t* q, const S* sm, int64_t G, float* w) {
  constexpr int P = C::PER_ROW;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = load16(sm + g * 2 * LANES);
    const __m512 m = load16(sm + g * 2 * LANES + LANES);
    for (int64_t j = g * GROUP / P; j < (g + 1) * GROUP / P; ++j) {
      __m512 c[P];
      C::read(q + j * LANES, c);
      for (int i = 0; i < P; ++i)
        _mm512_storeu_ps(w + (j * P + i) * LANES, _mm512_fmadd_ps(c[i], s, m));
    }
  }
}

// NT neighbouring tiles from their buffers (w: NT buffers [Kp][16], one after the other)
// against R rows of x as the caller holds them (row r at x + r * ldx): each activation,
// broadcast once into a register, feeds all NT tiles.
//
// k is summed in blocks of K_BLOCK in registers, each block's sums added into `sum` in memory
// (as the AVX2 path does, there for the reasons given at AVX2_K_BLOCK): one chain over a whole
// K took a real model's logits with a LoRA adapter 2.5e-3 from float64's on the AMX Xeon VM,
// against peft's float32 4.8e-4 (tests/unit/test_lora.py).
constexpr int64_t K_BLOCK = 64;

template <int NT, int R>
void float_tiles(const float* x, int64_t ldx, const float* w, int64_t Kp, float* out,
                 int64_t ldo, int valid_last, Ahead ahead) {
  constexpr int U = chains<R>();
  alignas(64) float sum[NT][R][LANES];
  __m512 acc[NT][R][U];
  for (int64_t kb = 0; kb < Kp; kb += K_BLOCK) {
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[t][r][u] = _mm512_setzero_ps();
  for (int64_t k0 = kb; k0 < std::min(Kp, kb + K_BLOCK); k0 += 4) {
    for (int64_t l = 0; l < ahead.per_step && ahead.p < ahead.end; ++l, ahead.p += 64)
      _mm_prefetch(ahead.p, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __m512 wv[NT];
      for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_ps(w + t * Kp * LANES + (k0 + i) * LANES);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(x[r * ldx + k0 + i]);
        for (int t = 0; t < NT; ++t) acc[t][r][i % U] = _mm512_fmadd_ps(wv[t], b, acc[t][r][i % U]);
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 s = acc[t][r][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[t][r][u]);
      if (kb > 0) s = _mm512_add_ps(s, _mm512_load_ps(sum[t][r]));
      _mm512_store_ps(sum[t][r], s);
    }
  }
  const __mmask16 last = valid_last >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid_last) - 1);
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + t * LANES, t == NT - 1 ? last : 0xFFFF,
                            _mm512_load_ps(sum[t][r]));
}

#else  // portable: the same tiles in plain loops over the 16 lanes

#if defined(__AVX2__) && defined(__FMA__)

inline void load16_avx2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16_avx2(const at::Half* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// quant_tile's factored form for 1-3 rows in AVX2 intrinsics (the AVX-512 one's arithmetic,
// a tile's 16 channels as two 8-lane vectors): per group of 32 k, scale * sum(code x) +
// minimum * sum(x), one FMA per code and row, the codes widened in registers and never
// written out; U chains per row and half-tile (2 R U accumulators) cover the FMA's latency.
// The next groups' codes are asked for as the AVX-512 path does (prefetch_group).
template <typename C, int R, typename S>
void avx2_factored_tile(const float* x, const float* xsum, const uint8_t* q, const S* sm,
                        int64_t G, float* out, int64_t ldo, int valid) {
  constexpr int P = C::PER_ROW, U = R == 1 ? 4 : (R == 2 ? 2 : 1);
  constexpr int64_t QBYTES = GROUP / P * LANES;
  const __m256i nibble = _mm256_set1_epi32(15);
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * QBYTES;
    prefetch_group<P>(qg, sm + g * 2 * LANES);
    const float* xg = x + g * GROUP * R;
    __m256 part[R][U][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) part[r][u][0] = part[r][u][1] = _mm256_setzero_ps();
    // JU rows of codes a turn, JU P a multiple of U: every chain index below is a constant
    // once the inner loops unroll (an index the compiler cannot fold keeps part on the stack)
    constexpr int JU = U > P ? U / P : 1;
    for (int j0 = 0; j0 < GROUP / P; j0 += JU) {
#pragma GCC unroll 4
      for (int jj = 0; jj < JU; ++jj) {
        const int j = j0 + jj;
        // channels 0-7 and 8-15 widened to 32 bits straight from memory (a load and one
        // shuffle each, not a shift of the register across lanes first)
        __m256i v[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          v[h] = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + j * LANES + 8 * h)));
        __m256 c[P][2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          if constexpr (P == 1) {
            c[0][h] = _mm256_cvtepi32_ps(v[h]);
          } else {  // byte c: k = 2j in the low nibble, 2j + 1 in the high
            c[0][h] = _mm256_cvtepi32_ps(_mm256_and_si256(v[h], nibble));
            c[P - 1][h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v[h], 4));
          }
        }
#pragma GCC unroll 2
        for (int i = 0; i < P; ++i) {
          const int u = (jj * P + i) % U;
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256 b = _mm256_broadcast_ss(xg + (j * P + i) * R + r);
            part[r][u][0] = _mm256_fmadd_ps(c[i][0], b, part[r][u][0]);
            part[r][u][1] = _mm256_fmadd_ps(c[i][1], b, part[r][u][1]);
          }
        }
      }
    }
    __m256 s[2], m[2];
    load16_avx2(sm + g * 2 * LANES, s[0], s[1]);
    load16_avx2(sm + g * 2 * LANES + LANES, m[0], m[1]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ss(xsum + g * R + r);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 p = part[r][0][h];
#pragma GCC unroll 4
        for (int u = 1; u < U; ++u) p = _mm256_add_ps(p, part[r][u][h]);
        acc[r][h] = _mm256_fmadd_ps(m[h], xs, _mm256_fmadd_ps(s[h], p, acc[r][h]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float sum[LANES];
    _mm256_store_ps(sum, acc[r][0]);
    _mm256_store_ps(sum + 8, acc[r][1]);
    std::copy(sum, sum + valid, out + r * ldo);
  }
}

#endif

inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

struct Int8Codes {
  static constexpr int PER_ROW = 1;
  static void read(const uint8_t* row, int c, float (&v)[PER_ROW]) { v[0] = row[c]; }
};

struct Int4Codes {
  static constexpr int PER_ROW = 2;
  static void read(const uint8_t* row, int c, float (&v)[PER_ROW]) {
    v[0] = row[c] & 15;
    v[1] = row[c] >> 4;
  }
};

template <typename C, int R, typename S>
void quant_tile(const float* x, const float* xsum, const uint8_t* q, const S* sm, int64_t G,
                float* out, int64_t ldo, int valid) {
  constexpr int P = C::PER_ROW;
  constexpr bool FACTORED = R < FACTORED_ROWS;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (FACTORED) return avx2_factored_tile<C, R, S>(x, xsum, q, sm, G, out, ldo, valid);
#endif
  float acc[R][LANES] = {};
  for (int64_t g = 0; g < G; ++g) {
    float s[LANES], m[LANES];
    for (int c = 0; c < LANES; ++c) {
      s[c] = to_float(sm[g * 2 * LANES + c]);
      m[c] = to_float(sm[g * 2 * LANES + LANES + c]);
    }
    float part[R][LANES] = {};
    auto& sum = FACTORED ? part : acc;
    const uint8_t* qg = q + g * (GROUP / P) * LANES;
    for (int j = 0; j < GROUP / P; ++j) {
      float w[P][LANES];
      for (int c = 0; c < LANES; ++c) {
        float v[P];
        C::read(qg + j * LANES, c, v);
        for (int i = 0; i < P; ++i) w[i][c] = FACTORED ? v[i] : std::fma(v[i], s[c], m[c]);
      }
      for (int i = 0; i < P; ++i)
        for (int r = 0; r < R; ++r) {
          const float xv = x[(g * GROUP + j * P + i) * R + r];
          for (int c = 0; c < LANES; ++c) sum[r][c] += w[i][c] * xv;
        }
    }
    if (FACTORED)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < LANES; ++c)
          acc[r][c] += s[c] * part[r][c] + m[c] * xsum[g * R + r];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < valid; ++c) out[r * ldo + c] = acc[r][c];
}

#if !(defined(__AVX2__) && defined(__FMA__))
template <typename C, typename S>
void dequant(const uint8_t* q, const S* sm, int64_t G, float* w) {
  constexpr int P = C::PER_ROW;
  for (int64_t j = 0; j < G * GROUP / P; ++j) {
    const int64_t g = j * P / GROUP;
    for (int c = 0; c < LANES; ++c) {
      float v[P];
      C::read(q + j * LANES, c, v);
      for (int i = 0; i < P; ++i)
        w[(j * P + i) * LANES + c] = std::fma(v[i], to_float(sm[g * 2 * LANES + c]),
                                              to_float(sm[g * 2 * LANES + LANES + c]));
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)

// 16 codes (bytes) to code * scale + min, into w[0..16)
inline void dequant16(__m128i codes, __m256 s_lo, __m256 s_hi, __m256 m_lo, __m256 m_hi,
                      float* w) {
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
  _mm256_storeu_ps(w, _mm256_fmadd_ps(lo, s_lo, m_lo));
  _mm256_storeu_ps(w + 8, _mm256_fmadd_ps(hi, s_hi, m_hi));
}

// The plain dequant below, in intrinsics: the compiler leaves that loop scalar, and at one row a
// call is nearly all dequantizing.
template <typename C, typename S>
void dequant(const uint8_t* q, const S* sm, int64_t G, float* w) {
  constexpr int P = C::PER_ROW;
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    __m256 s_lo, s_hi, m_lo, m_hi;
    load16_avx2(sm + g * 2 * LANES, s_lo, s_hi);
    load16_avx2(sm + g * 2 * LANES + LANES, m_lo, m_hi);
    for (int64_t j = g * GROUP / P; j < (g + 1) * GROUP / P; ++j) {
      const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * LANES));
      if constexpr (P == 1) {
        dequant16(row, s_lo, s_hi, m_lo, m_hi, w + j * LANES);
      } else {  // byte c: k = 2j in the low nibble, 2j + 1 in the high
        dequant16(_mm_and_si128(row, nibble), s_lo, s_hi, m_lo, m_hi, w + 2 * j * LANES);
        dequant16(_mm_and_si128(_mm_srli_epi16(row, 4), nibble), s_lo, s_hi, m_lo, m_hi,
                  w + (2 * j + 1) * LANES);
      }
    }
  }
}

// k values summed in registers before the partial sums are added into memory: one chain of
// FMAs over a whole K (1,536 for SmolLM2's down_proj) rounds K times in a row, and took the
// real model's logits (40 rows with a LoRA adapter, tests/unit/test_lora.py) 1.26e-3 from
// float64's, against oneDNN's 7.7e-4 and transformers' float32 7.9e-4; blocks of 128 gave
// 8.1e-4, of 64 5.8e-4, of 32 3.9e-4. A block's end costs 12 loads, adds and stores at 6 rows
// (768 FMAs at 64): a few per cent at 2,048 rows for 32, about half that for 64, lost in the
// noise at 1-64 rows (bench.quant_kernels, an AVX2 EPYC).
constexpr int64_t AVX2_K_BLOCK = 64;

// One K block [k0, k1) of a tile's buffer [Kp][16] (a tile being two 8-lane vectors) against
// RB (1-6) rows of x, added into out (the first block stored): 2 RB accumulators (times U
// chains over k below 4 rows: an FMA's result is ready ~4 cycles later, and two issue per
// cycle), two weight vectors and a broadcast in AVX2's 16 registers (6 rows: 12 accumulators,
// the register block of BLIS's Haswell kernel). `valid` < 16 (the matrix's last tile) loads and
// stores only the columns that exist.
//
// Every index into acc must be a constant once unrolled: a loop the compiler leaves rolled
// keeps acc in memory, and GCC then stores all 2 RB accumulators to the stack after every k
// (so it did, with the epilogue's loop around a copy of `valid` floats: 8 stores a k at 4
// rows, and this kernel took 2.2x oneDNN's time at 64 rows on an AVX2 EPYC).
template <int RB>
inline void avx2_kblock(const float* x, int64_t ldx, const float* wt, int64_t k0, int64_t k1,
                        float* out, int64_t ldo, bool first, int valid) {
  constexpr int U = RB >= 4 ? 1 : (RB == 1 ? 4 : 2);  // K is a multiple of 4
  __m256 acc[RB][U][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[r][u][0] = acc[r][u][1] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const float* wk = wt + (k + u) * LANES;
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k + u);
        acc[r][u][0] = _mm256_fmadd_ps(w0, b, acc[r][u][0]);
        acc[r][u][1] = _mm256_fmadd_ps(w1, b, acc[r][u][1]);
      }
    }
  }
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), iota);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), iota);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    __m256 lo = acc[r][0][0], hi = acc[r][0][1];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) {
      lo = _mm256_add_ps(lo, acc[r][u][0]);
      hi = _mm256_add_ps(hi, acc[r][u][1]);
    }
    float* o = out + r * ldo;
    if (valid == LANES) {
      if (!first) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(o));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(o + 8));
      }
      _mm256_storeu_ps(o, lo);
      _mm256_storeu_ps(o + 8, hi);
    } else {  // past the last column is the next row's first (another thread's) or nothing
      if (!first) {
        lo = _mm256_add_ps(lo, _mm256_maskload_ps(o, m0));
        hi = _mm256_add_ps(hi, _mm256_maskload_ps(o + 8, m1));
      }
      _mm256_maskstore_ps(o, m0, lo);
      _mm256_maskstore_ps(o + 8, m1, hi);
    }
  }
}

// RB (1-6) rows of x against one tile's buffer over the whole K, K block by K block, the
// sums in a buffer on the stack, then the `valid` columns into out.
template <int RB>
void avx2_rows(const float* x, int64_t ldx, const float* wt, int64_t Kp, float* out,
               int64_t ldo, int valid) {
  alignas(32) float sum[RB][LANES];
  for (int64_t kb = 0; kb < Kp; kb += AVX2_K_BLOCK)
    avx2_kblock<RB>(x, ldx, wt, kb, std::min(Kp, kb + AVX2_K_BLOCK), sum[0], LANES, kb == 0,
                    LANES);
  for (int r = 0; r < RB; ++r) std::copy(sum[r], sum[r] + valid, out + r * ldo);
}

// NT tiles' buffers against R rows (as the caller holds them), six rows at a time, then
// what is left in one pass (7 rows: 6 + 1 measured faster than 4 + 3, 8: 6 + 2 than 4 + 4).
template <int NT, int R>
void float_tiles(const float* x, int64_t ldx, const float* w, int64_t Kp, float* out,
                 int64_t ldo, int valid_last, Ahead) {
  for (int t = 0; t < NT; ++t) {
    const float* wt = w + t * Kp * LANES;
    const int valid = t == NT - 1 ? valid_last : LANES;
    for (int r0 = 0; r0 < R; r0 += 6) {
      const float* xr = x + r0 * ldx;
      float* o = out + r0 * ldo + t * LANES;
      switch (std::min(6, R - r0)) {
        case 6: avx2_rows<6>(xr, ldx, wt, Kp, o, ldo, valid); break;
        case 5: avx2_rows<5>(xr, ldx, wt, Kp, o, ldo, valid); break;
        case 4: avx2_rows<4>(xr, ldx, wt, Kp, o, ldo, valid); break;
        case 3: avx2_rows<3>(xr, ldx, wt, Kp, o, ldo, valid); break;
        case 2: avx2_rows<2>(xr, ldx, wt, Kp, o, ldo, valid); break;
        default: avx2_rows<1>(xr, ldx, wt, Kp, o, ldo, valid);
      }
    }
  }
}

// Rows run_groups hands a block at a time (the AVX-512 kernels take 8): 11 register blocks
// of 6, whose K block of x (66 x 64 floats, 17 KiB), the tile's K block (4 KiB) and their
// sums (4 KiB) stay in a 32 KiB L1 while the rows pass over them.
constexpr int64_t AVX2_RUN_ROWS = 66;
#define TOKENLINE_AVX2_TILES 1

// NT tiles' buffers against R (up to AVX2_RUN_ROWS) rows: for each tile and K block, every
// row, six at a time (then what is left), so that the block of weights is read from L1 by
// all R rows. Before, each 6 rows ran over a whole tile (36 KiB at K = 576, 96 at 1,536: from
// L2 every time), and an 8-row block split 6 + 2, the 2-row pass a load of weights for 4
// FMAs: a batch-64 float32 step's matmuls ran at 64-68% of the two cores' FMA peak (an AVX2
// EPYC: gate_up 1.40 ms, 161 GFLOP/s).
template <int NT>
void avx2_tiles(int64_t R, const float* x, int64_t ldx, const float* w, int64_t Kp, float* out,
                int64_t ldo, int valid_last) {
  for (int t = 0; t < NT; ++t) {
    const float* wt = w + t * Kp * LANES;
    const int valid = t == NT - 1 ? valid_last : static_cast<int>(LANES);
    float* o = out + t * LANES;
    for (int64_t kb = 0; kb < Kp; kb += AVX2_K_BLOCK) {
      const int64_t ke = std::min(Kp, kb + AVX2_K_BLOCK);
      const bool first = kb == 0;
      int64_t r0 = 0;
      for (; r0 + 6 <= R; r0 += 6)
        avx2_kblock<6>(x + r0 * ldx, ldx, wt, kb, ke, o + r0 * ldo, ldo, first, valid);
      const float* xr = x + r0 * ldx;
      float* orow = o + r0 * ldo;
      switch (R - r0) {
        case 5: avx2_kblock<5>(xr, ldx, wt, kb, ke, orow, ldo, first, valid); break;
        case 4: avx2_kblock<4>(xr, ldx, wt, kb, ke, orow, ldo, first, valid); break;
        case 3: avx2_kblock<3>(xr, ldx, wt, kb, ke, orow, ldo, first, valid); break;
        case 2: avx2_kblock<2>(xr, ldx, wt, kb, ke, orow, ldo, first, valid); break;
        case 1: avx2_kblock<1>(xr, ldx, wt, kb, ke, orow, ldo, first, valid); break;
        default: break;
      }
    }
  }
}

#else

template <int NT, int R>
void float_tiles(const float* x, int64_t ldx, const float* w, int64_t Kp, float* out,
                 int64_t ldo, int valid_last, Ahead) {
  for (int t = 0; t < NT; ++t) {
    float acc[R][LANES] = {};
    const float* wt = w + t * Kp * LANES;
    for (int64_t k = 0; k < Kp; ++k)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < LANES; ++c) acc[r][c] += wt[k * LANES + c] * x[r * ldx + k];
    const int valid = t == NT - 1 ? valid_last : LANES;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < valid; ++c) out[r * ldo + t * LANES + c] = acc[r][c];
  }
}

#endif

#endif

template <typename C, typename S>
void tile_block(int64_t R, const float* x, const float* xsum, const uint8_t* q, const S* s,
                int64_t G, float* out, int64_t ldo, int valid) {
  switch (R) {
    case 8: return quant_tile<C, 8, S>(x, xsum, q, s, G, out, ldo, valid);
    case 7: return quant_tile<C, 7, S>(x, xsum, q, s, G, out, ldo, valid);
    case 6: return quant_tile<C, 6, S>(x, xsum, q, s, G, out, ldo, valid);
    case 5: return quant_tile<C, 5, S>(x, xsum, q, s, G, out, ldo, valid);
    case 4: return quant_tile<C, 4, S>(x, xsum, q, s, G, out, ldo, valid);
    case 3: return quant_tile<C, 3, S>(x, xsum, q, s, G, out, ldo, valid);
    case 2: return quant_tile<C, 2, S>(x, xsum, q, s, G, out, ldo, valid);
    default: return quant_tile<C, 1, S>(x, xsum, q, s, G, out, ldo, valid);
  }
}

// Three tiles' buffers at a time against blocks of 8 rows (then what is left): 24
// accumulators, three weight vectors and a broadcast in 32 registers, each broadcast feeding
// three FMAs. Measured at batch 64 against 2 tiles x 8 rows (the kernel before), 4 x 6 and
// 2 x 12: 3 x 8 the fastest, by a few per cent (2 x 12 and 4 x 6 slower than 2 x 8).
constexpr int64_t FLOAT_TILES = 3;

#ifdef TOKENLINE_AVX2_TILES
constexpr int64_t RUN_ROWS = AVX2_RUN_ROWS;  // rows run_groups hands float_block at a time
#else
constexpr int64_t RUN_ROWS = 8;
#endif

template <int NT>
void float_rows(int64_t R, const float* x, int64_t ldx, const float* w, int64_t Kp, float* out,
                int64_t ldo, int valid, Ahead ahead) {
  switch (R) {
    case 8: return float_tiles<NT, 8>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 7: return float_tiles<NT, 7>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 6: return float_tiles<NT, 6>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 5: return float_tiles<NT, 5>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 4: return float_tiles<NT, 4>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 3: return float_tiles<NT, 3>(x, ldx, w, Kp, out, ldo, valid, ahead);
    case 2: return float_tiles<NT, 2>(x, ldx, w, Kp, out, ldo, valid, ahead);
    default: return float_tiles<NT, 1>(x, ldx, w, Kp, out, ldo, valid, ahead);
  }
}

// nt (1 to FLOAT_TILES) tiles' buffers against R (up to RUN_ROWS) rows. AVX2: up to 8 rows (a
// decode step of few requests, its weights streamed from memory) each register block runs
// over a whole tile (float_tiles: measured 5-7% faster there than avx2_tiles, batch 1 on an
// AVX2 EPYC), more rows by K blocks (avx2_tiles).
void float_block(int64_t nt, int64_t R, const float* x, int64_t ldx, const float* w, int64_t Kp,
                 float* out, int64_t ldo, int valid, Ahead ahead) {
#ifdef TOKENLINE_AVX2_TILES
  if (R > 8) {
    if (nt == 3) return avx2_tiles<3>(R, x, ldx, w, Kp, out, ldo, valid);
    if (nt == 2) return avx2_tiles<2>(R, x, ldx, w, Kp, out, ldo, valid);
    return avx2_tiles<1>(R, x, ldx, w, Kp, out, ldo, valid);
  }
#endif
  if (nt == 3) return float_rows<3>(R, x, ldx, w, Kp, out, ldo, valid, ahead);
  if (nt == 2) return float_rows<2>(R, x, ldx, w, Kp, out, ldo, valid, ahead);
  return float_rows<1>(R, x, ldx, w, Kp, out, ldo, valid, ahead);
}

#ifdef __AVX512BF16__
// bfloat16 tiles, w [T, K/2, 16, 2]: the 32 bits of lane c in row j of tile t hold channel
// 16t + c's weights at k = 2j and 2j + 1, so one VDPBF16PS multiplies a tile row by a pair of
// activations broadcast to every lane and adds both products into the channel's float32 sum
// (the layout of AMX's B operand too). Against oneDNN's bfloat16 inner product, which has a
// fixed cost of ~0.1 ms a call at 1-4 rows (on the AMX Xeon VM: a batch-1 step's 121
// projections 14 ms in cache, its weights read in 9), the same register blocks as the float32
// tiles, reading half their bytes. Sums are float32; the bias is added before the one
// rounding to bfloat16 (what oneDNN does), denormal products flushed (VDPBF16PS's rule).
template <int R>
inline void store_bf16_rows(__m512 (&acc)[R][chains<R>()], uint16_t* out, int64_t ldo,
                            const float* bias, int valid) {
  const __mmask16 mask = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
#pragma GCC unroll 4
    for (int u = 1; u < chains<R>(); ++u) sum = _mm512_add_ps(sum, acc[r][u]);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(sum, b));
    _mm256_mask_storeu_epi16(out + r * ldo, mask, reinterpret_cast<const __m256i&>(h));
  }
}

template <int NT, int R>
void bf16_tiles(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* out,
                int64_t ldo, const float* bias, int valid_last, Ahead ahead) {
  constexpr int U = chains<R>();
  __m512 acc[NT][R][U];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[t][r][u] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 8) {  // four pairs of k a step (K a multiple of 8)
    for (int64_t l = 0; l < ahead.per_step && ahead.p < ahead.end; ++l, ahead.p += 64)
      _mm_prefetch(ahead.p, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __m512i wv[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t)
        wv[t] = _mm512_loadu_si512(w + t * K * LANES + (k0 + 2 * i) * LANES);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + k0 + 2 * i, sizeof(pair));
        const __m512i b = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t)
          acc[t][r][i % U] = _mm512_dpbf16_ps(acc[t][r][i % U],
                                              reinterpret_cast<const __m512bh&>(wv[t]),
                                              reinterpret_cast<const __m512bh&>(b));
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
    store_bf16_rows<R>(acc[t], out + t * LANES, ldo, bias == nullptr ? nullptr : bias + t * LANES,
                       t == NT - 1 ? valid_last : 16);
}

template <int NT>
void bf16_rows(int64_t R, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K,
               uint16_t* out, int64_t ldo, const float* bias, int valid, Ahead ahead) {
  switch (R) {
    case 8: return bf16_tiles<NT, 8>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 7: return bf16_tiles<NT, 7>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 6: return bf16_tiles<NT, 6>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 5: return bf16_tiles<NT, 5>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 4: return bf16_tiles<NT, 4>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 3: return bf16_tiles<NT, 3>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    case 2: return bf16_tiles<NT, 2>(x, ldx, w, K, out, ldo, bias, valid, ahead);
    default: return bf16_tiles<NT, 1>(x, ldx, w, K, out, ldo, bias, valid, ahead);
  }
}

void bf16_block(int64_t nt, int64_t R, const uint16_t* x, int64_t ldx, const uint16_t* w,
                int64_t K, uint16_t* out, int64_t ldo, const float* bias, int valid,
                Ahead ahead) {
  if (nt == 3) return bf16_rows<3>(R, x, ldx, w, K, out, ldo, bias, valid, ahead);
  if (nt == 2) return bf16_rows<2>(R, x, ldx, w, K, out, ldo, bias, valid, ahead);
  return bf16_rows<1>(R, x, ldx, w, K, out, ldo, bias, valid, ahead);
}
#endif

// Batch rows are taken in blocks of 8, then whatever is left (1-7), in both paths.
inline int64_t block_rows(int64_t left) { return std::min<int64_t>(left, 8); }

// Each of R rows' sum per group of 32 (xsum [G][R]): quant_tile's factored form takes the
// minimum times it once per group.
inline void group_sums(const float* x, int64_t R, int64_t Kp, float* xsum) {
  for (int64_t g = 0; g < Kp / GROUP; ++g)
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0;
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) sum += x[r * Kp + k];
      xsum[g * R + r] = sum;
    }
}

// 2 to DEQUANT_ROWS - 1 rows of x [rows][Kp] into blocks of R rows interleaved per k
// ([Kp][R]): a tile then reads the R values of one k from one place (one pointer, constant
// offsets) instead of from R rows; also each row's sum per group (xsum [G][R] per block, for
// quant_tile's factored form). A few KiB: on the calling thread.
void pack_rows(const float* x, int64_t rows, int64_t Kp, float* packed, float* xsum) {
  const int64_t G = Kp / GROUP;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t R = block_rows(rows - r0);
    const float* src = x + r0 * Kp;
    float* dst = packed + r0 * Kp;
    for (int64_t k = 0; k < Kp; ++k)
      for (int64_t r = 0; r < R; ++r) dst[k * R + r] = src[r * Kp + k];
    group_sums(src, R, Kp, xsum + r0 * G);
  }
}

// Where a group of tiles' float32 weights come from, for run_groups. Codes (int8, int4):
// dequantized once per call into the thread's buffer, the next group's codes streamed in while
// one runs and its scales asked for at once.
template <typename C, typename S>
struct CodeTiles {
  static constexpr bool kBuffered = true;  // weights() writes into the thread's buffer
  const uint8_t* q;
  const S* sm;
  int64_t Kp, q_per_tile;

  int64_t scales_per_tile() const { return Kp / GROUP * 2 * LANES; }
  const float* weights(int64_t t, int64_t nt, float* buf) const {
    for (int64_t i = 0; i < nt; ++i)
      dequant<C, S>(q + (t + i) * q_per_tile, sm + (t + i) * scales_per_tile(), Kp / GROUP,
                    buf + i * Kp * LANES);
    return buf;
  }
  const char* bytes(int64_t t) const { return reinterpret_cast<const char*>(q + t * q_per_tile); }
  int64_t bytes_per_tile() const { return q_per_tile; }
  void prefetch_now(int64_t t, int64_t nt) const {
    const char* s = reinterpret_cast<const char*>(sm + t * scales_per_tile());
    for (int64_t b = 0; b < nt * scales_per_tile() * int64_t(sizeof(S)); b += 64)
      __builtin_prefetch(s + b, 0, 2);
  }
  int64_t steps() const { return Kp / 4; }  // of a block's k loop (Ahead's per_step)
  void block(int64_t nt, int64_t R, const float* x, int64_t ldx, const float* w, float* out,
             int64_t ldo, int64_t, int valid, Ahead ahead) const {
    float_block(nt, R, x, ldx, w, Kp, out, ldo, valid, ahead);
  }
};

// float32 weights already in tiles ([T, Kp, 16]): run where they lie, nothing to convert.
struct FloatTiles {
  static constexpr bool kBuffered = false;
  const float* w;
  int64_t Kp;

  const float* weights(int64_t t, int64_t, float*) const { return w + t * Kp * LANES; }
  const char* bytes(int64_t t) const { return reinterpret_cast<const char*>(w + t * Kp * LANES); }
  int64_t bytes_per_tile() const { return Kp * LANES * int64_t(sizeof(float)); }
  void prefetch_now(int64_t, int64_t) const {}
  int64_t steps() const { return Kp / 4; }
  void block(int64_t nt, int64_t R, const float* x, int64_t ldx, const float* w, float* out,
             int64_t ldo, int64_t, int valid, Ahead ahead) const {
    float_block(nt, R, x, ldx, w, Kp, out, ldo, valid, ahead);
  }
};

#ifdef __AVX512BF16__
// bfloat16 weights in tiles of 16 channels with k in pairs ([T, K/2, 16, 2], bf16_tiles): run
// where they lie, x in bfloat16, out in bfloat16 with the bias (float32) added before rounding.
struct Bf16Src {
  static constexpr bool kBuffered = false;
  const uint16_t* w;
  int64_t K;
  const float* bias;

  const uint16_t* weights(int64_t t, int64_t, float*) const { return w + t * K * LANES; }
  const char* bytes(int64_t t) const { return reinterpret_cast<const char*>(weights(t, 0, nullptr)); }
  int64_t bytes_per_tile() const { return K * LANES * int64_t(sizeof(uint16_t)); }
  void prefetch_now(int64_t, int64_t) const {}
  int64_t steps() const { return K / 8; }
  void block(int64_t nt, int64_t R, const uint16_t* x, int64_t ldx, const uint16_t* w,
             uint16_t* out, int64_t ldo, int64_t col, int valid, Ahead ahead) const {
    bf16_block(nt, R, x, ldx, w, K, out, ldo, bias == nullptr ? nullptr : bias + col, valid,
               ahead);
  }
};
#endif

// The tiles in groups of FLOAT_TILES, each group's weights made float32 once per call (or read
// as they are) and every row of x (row r at x + r * ldx) then run against them, as the caller
// holds x (no packing: an 8-row block's broadcasts come from 8 row streams). One parallel
// region per call; threads claim groups one at a time from a counter, so a thread that another
// process delays (the machine's cores are shared with the other services) holds up one group,
// not half the call. The next group's weights are prefetched while one runs (Ahead). Before,
// rows went in chunks of 64, each packed and then run by all tiles: a 2,048-row prefill
// dequantized every tile 32 times and woke the threads 64 times per call.
template <typename Src, typename X, typename O>
void run_groups(const Src& src, const X* x, int64_t ldx, int64_t M, int64_t Kp, int64_t N,
                int64_t T, O* out) {
  const int64_t groups = (T + FLOAT_TILES - 1) / FLOAT_TILES;
  const int64_t blocks = (M + RUN_ROWS - 1) / RUN_ROWS;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> wbuf;
    if (Src::kBuffered && static_cast<int64_t>(wbuf.size()) < FLOAT_TILES * Kp * LANES)
      wbuf.resize(FLOAT_TILES * Kp * LANES);
    int64_t g = next.fetch_add(1, std::memory_order_relaxed);
    while (g < groups) {
      // the next group is claimed now, so that its weights (from DRAM when the layer is not in
      // cache) arrive while this one runs
      const int64_t g_next = next.fetch_add(1, std::memory_order_relaxed);
      const int64_t t = g * FLOAT_TILES, nt = std::min(FLOAT_TILES, T - t);
      const int valid = static_cast<int>(std::min(LANES, N - (t + nt - 1) * LANES));
      const auto* w = src.weights(t, nt, wbuf.data());
      // its weight bytes spread evenly over this group's blocks and their k loops (asked for
      // all at once they overflow the misses a core can have in flight: measured slower at 16
      // rows); what a source wants at once (int8's scales, an eighth of that at most), now
      Ahead ahead{nullptr, nullptr, 0};
      int64_t slice = 0;
      if (g_next < groups) {
        const int64_t t_next = g_next * FLOAT_TILES, nt_next = std::min(FLOAT_TILES, T - t_next);
        src.prefetch_now(t_next, nt_next);
        ahead.p = src.bytes(t_next);
        ahead.end = ahead.p + nt_next * src.bytes_per_tile();
        slice = ((nt_next * src.bytes_per_tile() + 63) / 64 + blocks - 1) / blocks * 64;
        ahead.per_step = (slice / 64 + src.steps() - 1) / src.steps();
      }
      for (int64_t b = 0; b < blocks; ++b) {
        Ahead part = ahead;
        if (part.p != nullptr) {
          part.p = std::min(ahead.end, ahead.p + b * slice);
          part.end = std::min(ahead.end, part.p + slice);
        }
        // and the next block's output lines, for writing: each is written once, by one store
        // at the end of its block, and a store that misses waits for the line from DRAM (the
        // output of a 2,048-row gate_up is 25 MB, written 48 columns at a time: 8% of its time);
        // into L1 for 8 rows, into L2 for AVX2's 66 (12 KiB, a third of L1)
        const int64_t r0 = b * RUN_ROWS;
        for (int64_t r = r0 + RUN_ROWS; r < std::min(M, r0 + 2 * RUN_ROWS); ++r)
          for (int64_t i = 0; i < nt; ++i)
            __builtin_prefetch(out + r * N + (t + i) * LANES, 1, RUN_ROWS > 8 ? 2 : 3);
        src.block(nt, std::min(RUN_ROWS, M - r0), x + r0 * ldx, ldx, w, out + r0 * N + t * LANES,
                  N, t * LANES, valid, part);
      }
      g = g_next;
    }
  });
}

// Below DEQUANT_ROWS (from there run_groups): the rows packed once (pack_rows), then the
// tiles split across threads (or all on the calling thread: one_thread_bytes), each tile
// against every row, whose activations stay in cache. Scratch buffers are kept per thread
// across calls (no allocation, no page faults per call).
template <typename C, typename S>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                  int64_t N, int64_t q_per_tile) {
  const int64_t M = x.size(0), Kp = x.size(1), G = Kp / GROUP, T = q.size(0);
  const int64_t s_per_tile = G * 2 * LANES;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = reinterpret_cast<const S*>(scales.data_ptr());
  float* op = out.data_ptr<float>();
  if (M >= DEQUANT_ROWS) {
    run_groups(CodeTiles<C, S>{qp, sp, Kp, q_per_tile}, xp, Kp, M, Kp, N, T, op);
    return out;
  }
  thread_local std::vector<float> packed, xsum;
  if (static_cast<int64_t>(packed.size()) < M * Kp) packed.resize(M * Kp);
  if (static_cast<int64_t>(xsum.size()) < M * G) xsum.resize(M * G);
  const float* xs = xp;
  if (M > 1) {
    pack_rows(xp, M, Kp, packed.data(), xsum.data());
    xs = packed.data();
  } else {
    group_sums(xp, 1, Kp, xsum.data());
  }
  const float* sums = xsum.data();
  // 1-3 rows of a weight under one_thread_bytes run on the calling thread (grain T): see there
  const int64_t wbytes = T * (q_per_tile + s_per_tile * static_cast<int64_t>(sizeof(S)));
  const bool one_thread = M < FACTORED_ROWS &&
                          M * wbytes <= one_thread_bytes.load(std::memory_order_relaxed);
  at::parallel_for(0, T, one_thread ? T : 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int valid = static_cast<int>(std::min(LANES, N - t * LANES));
      for (int64_t r0 = 0; r0 < M; r0 += block_rows(M - r0))
        tile_block<C, S>(block_rows(M - r0), xs + r0 * Kp, sums + r0 * G, qp + t * q_per_tile,
                         sp + t * s_per_tile, G, op + r0 * N + t * LANES, N, valid);
    }
  });
  return out;
}

void check(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
           int64_t N, int64_t q_rows_per_k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, Kp]");
  TORCH_CHECK(x.size(1) % GROUP == 0, "Kp must be a multiple of 32");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == LANES &&
                  q.size(1) * q_rows_per_k == x.size(1),
              "weight tiles do not match x");
  TORCH_CHECK(q.size(0) * LANES >= N && (q.size(0) - 1) * LANES < N, "N does not match tiles");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == q.size(0) &&
                  scales.size(1) == x.size(1) / GROUP && scales.size(2) == 2 &&
                  scales.size(3) == LANES,
              "scale_min must be [T, Kp / 32, 2, 16]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf || scales.scalar_type() == torch::kFloat,
              "scales must be float16 or float32");
}

template <typename C>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& q,
                     const torch::Tensor& scale_min, int64_t N, int64_t k_per_byte) {
  check(x, q, scale_min, N, k_per_byte);
  TORCH_CHECK(q.scalar_type() == torch::kByte, "weight codes must be uint8");
  const int64_t q_per_tile = x.size(1) / k_per_byte * LANES;
  if (scale_min.scalar_type() == torch::kHalf)
    return run<C, at::Half>(x, q, scale_min, N, q_per_tile);
  return run<C, float>(x, q, scale_min, N, q_per_tile);
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale_min, int64_t N) {
  return linear<Int8Codes>(x, q, scale_min, N, 1);
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale_min, int64_t N) {
  return linear<Int4Codes>(x, q, scale_min, N, 2);
}

// float32 weights in the same tiles, w [T, K, 16] (K a multiple of 4; x [M, K] with unit
// stride along K, rows at any stride): every call, from one row, runs the groups of three tiles
// straight from the weights, the next group prefetched while one runs. Float32 sums in k order
// per chain, so a result differs from F.linear's by summation order only.
torch::Tensor float_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const std::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "x must be float32 [M, K] with unit stride along K");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat && w.is_contiguous() &&
                  w.size(2) == LANES && w.size(1) == x.size(1) && x.size(1) % 4 == 0,
              "weight tiles must be contiguous float32 [T, K, 16] with x's K, a multiple of 4");
  TORCH_CHECK(w.size(0) * LANES >= N && (w.size(0) - 1) * LANES < N, "N does not match tiles");
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M > 0)
    run_groups(FloatTiles{w.data_ptr<float>(), K}, x.data_ptr<float>(), x.stride(0), M, K, N,
               w.size(0), out.data_ptr<float>());
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N && bias->scalar_type() == torch::kFloat,
                "bias must be float32 [N]");
    out.add_(*bias);
  }
  return out;
}

// bfloat16 weights in tiles with k in pairs, w [T, K/2, 16, 2] (K a multiple of 8; x [M, K]
// bfloat16 with unit stride along K, rows at any stride): x @ w.T (+ bias, float32 [N]) in
// bfloat16, float32 sums, every call from one row through the same groups of three tiles as
// float_linear. Built only where the CPU has AVX512-BF16 (bf16_tiles_built).
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w,
                          const std::optional<torch::Tensor>& bias, int64_t N) {
#ifdef __AVX512BF16__
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "x must be bfloat16 [M, K] with unit stride along K");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() &&
                  w.size(2) == LANES && w.size(3) == 2 && w.size(1) * 2 == x.size(1) &&
                  x.size(1) % 8 == 0,
              "weight tiles must be contiguous bfloat16 [T, K/2, 16, 2] with x's K, a "
              "multiple of 8");
  TORCH_CHECK(w.size(0) * LANES >= N && (w.size(0) - 1) * LANES < N, "N does not match tiles");
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N && bias->scalar_type() == torch::kFloat &&
                    bias->is_contiguous(),
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M > 0)
    run_groups(Bf16Src{reinterpret_cast<const uint16_t*>(w.data_ptr()), K, b},
               reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, N, w.size(0),
               reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: the C++ kernels were built without AVX512-BF16");
  return x;
#endif
}

bool bf16_tiles_built() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// The limit under which 1-3 row calls run on the calling thread; returns the previous one.
int64_t set_one_thread_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "one_thread_bytes must be >= 0");
  return one_thread_bytes.exchange(bytes, std::memory_order_relaxed);
}

int64_t one_thread_bytes_default() { return ONE_THREAD_BYTES_DEFAULT; }

int64_t dequant_rows() { return DEQUANT_ROWS; }

bool vectorized() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// Which vector code the float32 tiles were built with: avx512, avx2 (with FMA) or portable.
std::string float_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x @ w.T for int8 group-32 weight tiles (float32, CPU)");
  m.def("int4_linear", &int4_linear, "x @ w.T for int4 group-32 scale+min weight tiles");
  m.def("float_linear", &float_linear, "x @ w.T (+ bias) for float32 weight tiles",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("n"));
  m.def("bf16_linear", &bf16_linear, "x @ w.T (+ bias) for bfloat16 weight tiles (AVX512-BF16)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("n"));
  m.def("bf16_tiles_built", &bf16_tiles_built, "whether bf16_linear was compiled in");
  m.def("set_one_thread_bytes", &set_one_thread_bytes,
        "weight bytes x rows under which 1-3 row calls stay on the calling thread (0: never)");
  m.def("one_thread_bytes_default", &one_thread_bytes_default,
        "the limit set_one_thread_bytes starts from (and quant.calibrate_small_calls sets for one)");
  m.def("dequant_rows", &dequant_rows,
        "from how many rows a call dequantizes its tiles (1: every call; no 1-3 row path)");
  m.def("vectorized", &vectorized, "whether the AVX512 tiles were compiled in");
  m.def("float_isa", &float_isa, "the float32 tiles' vector code: avx512, avx2 or portable");
}
