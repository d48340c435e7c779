// Weight-only int8 and int4 matmuls on CPU: float32 activations in and out, float32 sums.
//
//   out[m, n] = sum_k x[m, k] * w[n, k]
//
// Weights are stored in tiles of 16 output channels, interleaved per k, so one 16-byte load
// gives one k of 16 channels: one vector of dequantized weights then feeds every batch row of a
// block held in registers (up to 8 rows of accumulators). Below 16 rows the weights are
// dequantized in registers, never in memory (batch 1 reads 1 or 0.5 bytes a weight, plus
// scales); from 16 rows each tile is dequantized once per 64 rows into a float32 buffer and
// two tiles at a time run from their buffers, each activation broadcast once for both.
//
//   int8  q   [T, Kp, 16] uint8        code of channel 16t + c at k: q[t, k, c]
//   int4  q   [T, Kp/2, 16] uint8      byte (t, j, c) holds k = 2j (low nibble), 2j + 1 (high)
//   both  sm  [T, G, 2, 16] half|float w = sm[t, k / 32, 0, c] * code + sm[t, k / 32, 1, c]
//         (a scale and a minimum per 32 values: GGUF Q8_0 is scale d, minimum -128 d with
//         codes q + 128; Q4_0, Q4_1 and Q4_K's sub-blocks map as quant.py says)
//   x [M, Kp] float32 (Kp = 32 G: the caller pads K), out [M, N] float32, T = ceil(N / 16).
//
// The dequantized weight is what the reference computes: code * scale + min is one FMA, and
// with a half scale the product is exact in float32 (8 + 11 bits), so the reference's single
// rounding when it adds min gives the same number. Only the order of the K-sum differs from a
// dequantize-then-matmul reference, so the two agree within float32 summation error.
//
// With AVX512F (the build is -march=native) the tiles run in intrinsics; elsewhere (AVX2-only
// machines) the same loops in plain C++, which the compiler vectorizes over the 16 lanes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;   // output channels per tile
constexpr int64_t GROUP = 32;   // k values per scale
constexpr int64_t ROW_CHUNK = 64;  // batch rows whose activations stay in cache across tiles
// from this many rows in a chunk a tile is dequantized once into float32 (see float_tile)
constexpr int64_t DEQUANT_ROWS = 16;

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
template <typename C, int R, typename S>
void quant_tile(const float* x, const uint8_t* q, const S* sm, int64_t G,
                float* out, int64_t ldo, int valid) {
  constexpr int U = chains<R>();
  constexpr int P = C::PER_ROW;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = load16(sm + g * 2 * LANES);
    const __m512 m = load16(sm + g * 2 * LANES + LANES);
    const uint8_t* qg = q + g * (GROUP / P) * LANES;
    const float* xg = x + g * GROUP * R;
#pragma GCC unroll 32
    for (int j = 0; j < GROUP / P; ++j) {
      __m512 c[P];
      C::read(qg + j * LANES, c);
#pragma GCC unroll 2
      for (int i = 0; i < P; ++i) {
        const int k = j * P + i;
        const __m512 w = _mm512_fmadd_ps(c[i], s, m);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          acc[r][k % U] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[k * R + r]), acc[r][k % U]);
      }
    }
  }
  store_rows<R>(acc, out, ldo, valid);
}

// Large batches: a tile is dequantized once into a float32 buffer w [Kp][16] (the numbers the
// tiles above compute in registers) and every row block then runs from it: no conversions in
// the inner loop, and two tiles share each activation (float_tile2). The sums run in the same
// order as in the register path. Measured at batch 64 (1 thread): 5-12% faster than the
// register path, 0-9% slower than oneDNN float32 on SmolLM2's projections.
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

template <int R>
void float_tile(const float* x, const float* w, int64_t Kp, float* out, int64_t ldo,
                int valid) {
  constexpr int U = chains<R>();
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < Kp; k0 += 4) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512 wv = _mm512_loadu_ps(w + (k0 + i) * LANES);
      const float* xk = x + (k0 + i) * R;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][i % U] = _mm512_fmadd_ps(wv, _mm512_set1_ps(xk[r]), acc[r][i % U]);
    }
  }
  store_rows<R>(acc, out, ldo, valid);
}

// Two neighbouring tiles from their buffers: each activation, broadcast once into a register,
// feeds both (half the loads per FMA of one tile at a time).
template <int R>
void float_tile2(const float* x, const float* w0, const float* w1, int64_t Kp, float* out,
                 int64_t ldo, int valid_last) {
  constexpr int U = chains<R>();
  __m512 a0[R][U], a1[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) a0[r][u] = a1[r][u] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < Kp; k0 += 4) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512 wa = _mm512_loadu_ps(w0 + (k0 + i) * LANES);
      const __m512 wb = _mm512_loadu_ps(w1 + (k0 + i) * LANES);
      const float* xk = x + (k0 + i) * R;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(xk[r]);
        a0[r][i % U] = _mm512_fmadd_ps(wa, b, a0[r][i % U]);
        a1[r][i % U] = _mm512_fmadd_ps(wb, b, a1[r][i % U]);
      }
    }
  }
  store_rows<R>(a0, out, ldo, 16);
  store_rows<R>(a1, out + LANES, ldo, valid_last);
}

#else  // portable: the same tiles in plain loops over the 16 lanes

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
void quant_tile(const float* x, const uint8_t* q, const S* sm, int64_t G,
                float* out, int64_t ldo, int valid) {
  constexpr int P = C::PER_ROW;
  float acc[R][LANES] = {};
  for (int64_t g = 0; g < G; ++g) {
    float s[LANES], m[LANES];
    for (int c = 0; c < LANES; ++c) {
      s[c] = to_float(sm[g * 2 * LANES + c]);
      m[c] = to_float(sm[g * 2 * LANES + LANES + c]);
    }
    const uint8_t* qg = q + g * (GROUP / P) * LANES;
    for (int j = 0; j < GROUP / P; ++j) {
      float w[P][LANES];
      for (int c = 0; c < LANES; ++c) {
        float v[P];
        C::read(qg + j * LANES, c, v);
        for (int i = 0; i < P; ++i) w[i][c] = std::fma(v[i], s[c], m[c]);
      }
      for (int i = 0; i < P; ++i)
        for (int r = 0; r < R; ++r) {
          const float xv = x[(g * GROUP + j * P + i) * R + r];
          for (int c = 0; c < LANES; ++c) acc[r][c] += w[i][c] * xv;
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < valid; ++c) out[r * ldo + c] = acc[r][c];
}

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

template <int R>
void float_tile(const float* x, const float* w, int64_t Kp, float* out, int64_t ldo,
                int valid) {
  float acc[R][LANES] = {};
  for (int64_t k = 0; k < Kp; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < LANES; ++c) acc[r][c] += w[k * LANES + c] * x[k * R + r];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < valid; ++c) out[r * ldo + c] = acc[r][c];
}

template <int R>
void float_tile2(const float* x, const float* w0, const float* w1, int64_t Kp, float* out,
                 int64_t ldo, int valid_last) {
  float_tile<R>(x, w0, Kp, out, ldo, LANES);
  float_tile<R>(x, w1, Kp, out + LANES, ldo, valid_last);
}

#endif

// Batch rows are taken in blocks of 8, then whatever is left (1-7): two tiles x 8 rows is 16
// accumulators, which with the two weight vectors and a broadcast stays in registers (two
// tiles x 12 rows spilled here, and measured slower than 8).
inline int64_t block_rows(int64_t left) { return left >= 8 ? 8 : left; }

template <typename C, typename S>
void tile_block(int64_t R, const float* x, const uint8_t* q, const S* s, int64_t G, float* out,
                int64_t ldo, int valid) {
  switch (R) {
    case 8: return quant_tile<C, 8, S>(x, q, s, G, out, ldo, valid);
    case 7: return quant_tile<C, 7, S>(x, q, s, G, out, ldo, valid);
    case 6: return quant_tile<C, 6, S>(x, q, s, G, out, ldo, valid);
    case 5: return quant_tile<C, 5, S>(x, q, s, G, out, ldo, valid);
    case 4: return quant_tile<C, 4, S>(x, q, s, G, out, ldo, valid);
    case 3: return quant_tile<C, 3, S>(x, q, s, G, out, ldo, valid);
    case 2: return quant_tile<C, 2, S>(x, q, s, G, out, ldo, valid);
    default: return quant_tile<C, 1, S>(x, q, s, G, out, ldo, valid);
  }
}

// One or two tiles' buffers (w1 null: one) against R rows.
void float_block(int64_t R, const float* x, const float* w0, const float* w1, int64_t Kp,
                 float* out, int64_t ldo, int valid) {
#define FLOAT_CASE(n)                                                        \
  case n:                                                                    \
    if (w1) return float_tile2<n>(x, w0, w1, Kp, out, ldo, valid);           \
    return float_tile<n>(x, w0, Kp, out, ldo, valid);
  switch (R) {
    FLOAT_CASE(8) FLOAT_CASE(7) FLOAT_CASE(6) FLOAT_CASE(5) FLOAT_CASE(4)
    FLOAT_CASE(3) FLOAT_CASE(2) default: FLOAT_CASE(1)
  }
#undef FLOAT_CASE
}

// Tiles split across threads; each thread walks its tiles once per chunk of 64 batch rows, so
// a chunk's activations are read from cache for every tile. A chunk is first copied into
// blocks of R rows interleaved per k ([Kp][R]): a tile then reads the R values of one k from
// one place (one pointer, constant offsets) instead of from R rows.
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
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> packed(M > 1 ? std::min(M, ROW_CHUNK) * Kp : 0);
    std::vector<float> wbuf(M >= DEQUANT_ROWS ? 2 * Kp * LANES : 0);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - m0);
      const float* xs = xp + m0 * Kp;
      if (rows > 1) {
        float* dst = packed.data();
        for (int64_t r0 = 0; r0 < rows; r0 += block_rows(rows - r0)) {
          const int64_t R = block_rows(rows - r0);
          for (int64_t k = 0; k < Kp; ++k)
            for (int64_t r = 0; r < R; ++r) dst[k * R + r] = xs[(r0 + r) * Kp + k];
          dst += R * Kp;
        }
        xs = packed.data();
      }
      if (rows >= DEQUANT_ROWS) {
        for (int64_t t = begin; t < end; t += 2) {
          const bool two = t + 1 < end;
          const int valid = static_cast<int>(std::min(LANES, N - (t + two) * LANES));
          for (int64_t i = 0; i <= two; ++i)
            dequant<C, S>(qp + (t + i) * q_per_tile, sp + (t + i) * s_per_tile, G,
                                   wbuf.data() + i * Kp * LANES);
          const float* xb = xs;
          for (int64_t r0 = 0; r0 < rows; r0 += block_rows(rows - r0)) {
            const int64_t R = block_rows(rows - r0);
            float_block(R, xb, wbuf.data(), two ? wbuf.data() + Kp * LANES : nullptr, Kp,
                        op + (m0 + r0) * N + t * LANES, N, valid);
            xb += R * Kp;
          }
        }
        continue;
      }
      for (int64_t t = begin; t < end; ++t) {
        const int valid = static_cast<int>(std::min(LANES, N - t * LANES));
        const float* xb = xs;
        for (int64_t r0 = 0; r0 < rows; r0 += block_rows(rows - r0)) {
          const int64_t R = block_rows(rows - r0);
          tile_block<C, S>(R, xb, qp + t * q_per_tile, sp + t * s_per_tile, G,
                           op + (m0 + r0) * N + t * LANES, N, valid);
          xb += R * Kp;
        }
      }
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

bool vectorized() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x @ w.T for int8 group-32 weight tiles (float32, CPU)");
  m.def("int4_linear", &int4_linear, "x @ w.T for int4 group-32 scale+min weight tiles");
  m.def("vectorized", &vectorized, "whether the AVX512 tiles were compiled in");
}
