// Decode attention straight from the paged KV cache on CPU (float32 or bfloat16), one pass over
// the cache.
//
// The torch path gathers each request's blocks into a padded copy, then runs SDPA over the
// copy: the cache is read, written and read again. Here each (request, kv head) task walks its
// block table and reads every key and value row once, for all the query heads that share it.
//
//   q        [N, Hq, D]        one new token per row; row n belongs to request rows[n]
//   k_cache  [S, Hkv, D]       S = num_blocks * page_size; position p of request b lives in
//   v_cache  [S, Hkv, D]       slot tables[b, p / page_size] * page_size + p % page_size
//   tables   [B, W] int32      entries past a request's end are never read
//   seq_lens [B] int32         positions [0, seq_lens[b]) are attended to, or with a sliding
//   window   int64             window W > 0 only the last W of them
//   out      [N, Hq, D]
//
// Per task: scores s[g][t] = q_g . k_t * scale, a softmax over t, then sum_t p[g][t] v_t.
// Sums run in float32 in a different order from SDPA's: results agree to ~1e-6.
//
// bfloat16 (q, caches and out all bf16; scores, softmax and sums float32): with AVX512-BF16
// the q.k dots are _mm512_dpbf16_ps (bf16 pairs multiplied exactly, summed in float32) and
// each value row is widened to float32 by a 16-bit shift for the FMA into float32 sums; the
// result is rounded to bf16 once, to nearest even. Elsewhere (AVX2, or AVX512 without BF16) a
// portable path does the same arithmetic in scalar code the compiler vectorizes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENLINE_AVX512_BF16 1
#endif

namespace {

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

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask
// for this head's rows of the next block while the current one is being read.
template <typename T>
inline void prefetch_block(const T* cache, int32_t block, int64_t page, int64_t row,
                           int64_t D) {
  const char* base = reinterpret_cast<const char*>(cache + static_cast<int64_t>(block) * page * row);
  constexpr int64_t S = sizeof(T);
  for (int64_t j = 0; j < page; ++j)
    for (int64_t off = 0; off < D * S; off += 64) __builtin_prefetch(base + j * row * S + off);
}

// Calls f(t - begin, row t of the cache) for the sequence's tokens begin..len-1 in order,
// walking its block table and prefetching the next block while this one is read.
template <typename T, typename F>
inline void for_each_row(const T* cache, const int32_t* __restrict table, int64_t begin,
                         int64_t len, int64_t page, int64_t row, int64_t D, F&& f) {
  for (int64_t blk = begin / page, t0 = blk * page; t0 < len; t0 += page, ++blk) {
    const T* b = cache + static_cast<int64_t>(table[blk]) * page * row;
    const int64_t n = std::min(page, len - t0);
    if (t0 + page < len) prefetch_block(cache, table[blk + 1], page, row, D);
    for (int64_t j = std::max<int64_t>(0, begin - t0); j < n; ++j) f(t0 + j - begin, b + j * row);
  }
}

template <int D, int G>
void attend(const float* __restrict q, const float* __restrict k_cache,
            const float* __restrict v_cache, const int32_t* __restrict table, int64_t begin,
            int64_t end, int64_t page, int64_t row, float scale, float* __restrict scores,
            float* __restrict out) {
  const int64_t len = end - begin;  // rows attended to: positions [begin, end)
  // scores s[g][t] = q_g . k_t * scale; G and D are compile-time, so the G dot products of a
  // key row run side by side in registers
  float maxes[G];
  // finite: the file is built with -ffast-math, which assumes no infinities
  for (int g = 0; g < G; ++g) maxes[g] = std::numeric_limits<float>::lowest();
  for_each_row(k_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const float* __restrict kr) {
    float dots[G];
    for (int g = 0; g < G; ++g) dots[g] = 0.f;
    for (int d = 0; d < D; ++d) {
      const float x = kr[d];
      for (int g = 0; g < G; ++g) dots[g] += q[g * D + d] * x;
    }
    for (int g = 0; g < G; ++g) {
      const float x = dots[g] * scale;
      scores[g * len + t] = x;
      maxes[g] = std::max(maxes[g], x);
    }
  });
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * len;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // a vector exp (libmvec)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - maxes[g]);
      sum += sg[t];
    }
    inv[g] = 1.f / sum;
  }
  float acc[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  for_each_row(v_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const float* __restrict vr) {
    float w[G];
    for (int g = 0; g < G; ++g) w[g] = scores[g * len + t];
    for (int d = 0; d < D; ++d) {
      const float x = vr[d];
      for (int g = 0; g < G; ++g) acc[g][d] += w[g] * x;
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv[g];
}

// exp(s - max) over each query head's scores in place; returns 1 / sum per head in `inv`
template <int G>
inline void softmax_rows(float* __restrict scores, int64_t len, const float* maxes, float* inv) {
  for (int g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * len;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - maxes[g]);
      sum += sg[t];
    }
    inv[g] = 1.f / sum;
  }
}

#ifdef TOKENLINE_AVX512_BF16

// 32 bf16 of a row from element d on (zeros past D: they add nothing to a dot product)
template <int D>
inline __m512bh load_pairs(const uint16_t* p, int d) {
  const __mmask32 m = D - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p + d));
}

// 16 bf16 widened to float32
inline __m512 load_wide(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int D, int G>
void attend_bf16(const uint16_t* __restrict q, const uint16_t* __restrict k_cache,
                 const uint16_t* __restrict v_cache, const int32_t* __restrict table,
                 int64_t begin, int64_t end, int64_t page, int64_t row, float scale,
                 float* __restrict scores, uint16_t* __restrict out) {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  constexpr int C = (D + 31) / 32;  // 32-wide chunks of a row for the dots
  constexpr int V = D / 16;  // 16-wide float32 chunks of a row for the sums
  const int64_t len = end - begin;
  __m512bh qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load_pairs<D>(q + g * D, c * 32);
  float maxes[G];
  for (int g = 0; g < G; ++g) maxes[g] = std::numeric_limits<float>::lowest();
  for_each_row(k_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const uint16_t* __restrict kr) {
    __m512bh kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load_pairs<D>(kr, c * 32);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
      const float x = _mm512_reduce_add_ps(acc) * scale;
      scores[g * len + t] = x;
      maxes[g] = std::max(maxes[g], x);
    }
  });
  float inv[G];
  softmax_rows<G>(scores, len, maxes, inv);
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_row(v_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const uint16_t* __restrict vr) {
    for (int c = 0; c < V; ++c) {
      const __m512 x = load_wide(vr + c * 16);
      for (int g = 0; g < G; ++g)
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + t]), x, acc[g][c]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) {
      const __m512 o = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + c * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o)));
    }
}

constexpr bool kFastBf16 = true;

#else  // portable: the same arithmetic, widened element by element

template <int D, int G>
void attend_bf16(const uint16_t* __restrict q, const uint16_t* __restrict k_cache,
                 const uint16_t* __restrict v_cache, const int32_t* __restrict table,
                 int64_t begin, int64_t end, int64_t page, int64_t row, float scale,
                 float* __restrict scores, uint16_t* __restrict out) {
  const int64_t len = end - begin;
  float qf[G * D];
  for (int i = 0; i < G * D; ++i) qf[i] = bf16_to_float(q[i]);
  float maxes[G];
  for (int g = 0; g < G; ++g) maxes[g] = std::numeric_limits<float>::lowest();
  for_each_row(k_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const uint16_t* __restrict kr) {
    float kf[D];
    for (int d = 0; d < D; ++d) kf[d] = bf16_to_float(kr[d]);
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += qf[g * D + d] * kf[d];
      const float x = dot * scale;
      scores[g * len + t] = x;
      maxes[g] = std::max(maxes[g], x);
    }
  });
  float inv[G];
  softmax_rows<G>(scores, len, maxes, inv);
  float acc[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  for_each_row(v_cache, table, begin, end, page, row, D, [&](int64_t t,
                                                            const uint16_t* __restrict vr) {
    float vf[D];
    for (int d = 0; d < D; ++d) vf[d] = bf16_to_float(vr[d]);
    for (int g = 0; g < G; ++g) {
      const float w = scores[g * len + t];
      for (int d = 0; d < D; ++d) acc[g][d] += w * vf[d];
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = float_to_bf16(acc[g][d] * inv[g]);
}

constexpr bool kFastBf16 = false;

#endif

template <typename T>
using AttendFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, int64_t,
                          int64_t, int64_t, float, float*, T*);

// one table of instantiations per element type: float32 -> attend, bfloat16 -> attend_bf16
template <typename T, int D, int G>
constexpr AttendFn<T> kernel_for() {
  if constexpr (std::is_same_v<T, float>) return attend<D, G>;
  else return attend_bf16<D, G>;
}

template <typename T, int D>
AttendFn<T> pick_group(int64_t G) {
  switch (G) {
    case 1: return kernel_for<T, D, 1>();
    case 2: return kernel_for<T, D, 2>();
    case 3: return kernel_for<T, D, 3>();
    case 4: return kernel_for<T, D, 4>();
    case 5: return kernel_for<T, D, 5>();
    case 6: return kernel_for<T, D, 6>();
    case 7: return kernel_for<T, D, 7>();
    case 8: return kernel_for<T, D, 8>();
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> pick(int64_t D, int64_t G) {
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

template <typename T>
void run(const T* qp, const T* kp, const T* vp, const int32_t* tp, const int32_t* lp,
         const int64_t* rp, T* op, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t W,
         int64_t page_size, float sc, int64_t window, AttendFn<T> fn) {
  const int64_t G = Hq / Hkv, row = Hkv * D;
  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / Hkv, h = i % Hkv, b = rp[n];
      const int64_t len = lp[b];
      const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(static_cast<size_t>(G * (len - begin)));
      const int64_t head = n * Hq + h * G;
      fn(qp + head * D, kp + h * D, vp + h * D, tp + b * W, begin, len, page_size, row, sc,
         scores.data(), op + head * D);
    }
  });
}

}  // namespace

bool supports(int64_t head_dim, int64_t group) {
  return pick<float>(head_dim, group) != nullptr && pick<uint16_t>(head_dim, group) != nullptr;
}

// Whether the bfloat16 kernel was built with AVX512-BF16 (else it is the portable one).
bool fast_bf16() { return kFastBf16; }

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor seq_lens, torch::Tensor rows,
                           int64_t page_size, double scale, int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
              k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_decode: q and caches all float32 or all bfloat16");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: contiguous q and caches");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32 &&
              rows.dtype() == torch::kInt64, "paged_decode: int32 tables and lens, int64 rows");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && pick<float>(D, Hq / Hkv) != nullptr,
              "paged_decode: unsupported head size or group");
  auto tables_c = tables.contiguous();
  auto out = torch::empty_like(q);
  const int32_t* tp = tables_c.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t W = tables_c.size(1);
  const float sc = static_cast<float>(scale);
  if (dtype == torch::kFloat32) {
    run<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp,
               lp, rp, out.data_ptr<float>(), N, Hq, Hkv, D, W, page_size, sc, window,
               pick<float>(D, Hq / Hkv));
  } else {
    auto bits = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    run<uint16_t>(bits(q), bits(k_cache), bits(v_cache), tp, lp, rp, bits(out), N, Hq, Hkv, D,
                  W, page_size, sc, window, pick<uint16_t>(D, Hq / Hkv));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "decode attention over a paged KV cache (float32 or bfloat16, CPU)");
  m.def("supports", &supports, "whether a head size and GQA group size are compiled in");
  m.def("fast_bf16", &fast_bf16, "whether the bfloat16 kernel uses AVX512-BF16");
}
