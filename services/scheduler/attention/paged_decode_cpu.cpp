// Decode attention straight from the paged KV cache on CPU (float32), one pass over the cache.
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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask
// for this head's rows of the next block while the current one is being read.
inline void prefetch_block(const float* cache, int32_t block, int64_t page, int64_t row,
                           int64_t D) {
  const char* base = reinterpret_cast<const char*>(cache + static_cast<int64_t>(block) * page * row);
  for (int64_t j = 0; j < page; ++j)
    for (int64_t off = 0; off < D * 4; off += 64) __builtin_prefetch(base + j * row * 4 + off);
}

// Calls f(t - begin, row t of the cache) for the sequence's tokens begin..len-1 in order,
// walking its block table and prefetching the next block while this one is read.
template <typename F>
inline void for_each_row(const float* cache, const int32_t* __restrict table, int64_t begin,
                         int64_t len, int64_t page, int64_t row, int64_t D, F&& f) {
  for (int64_t blk = begin / page, t0 = blk * page; t0 < len; t0 += page, ++blk) {
    const float* b = cache + static_cast<int64_t>(table[blk]) * page * row;
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

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, float, float*, float*);

template <int D>
AttendFn pick_group(int64_t G) {
  switch (G) {
    case 1: return attend<D, 1>;
    case 2: return attend<D, 2>;
    case 3: return attend<D, 3>;
    case 4: return attend<D, 4>;
    case 5: return attend<D, 5>;
    case 6: return attend<D, 6>;
    case 7: return attend<D, 7>;
    case 8: return attend<D, 8>;
    default: return nullptr;
  }
}

AttendFn pick(int64_t D, int64_t G) {
  switch (D) {
    case 32: return pick_group<32>(G);
    case 64: return pick_group<64>(G);
    case 80: return pick_group<80>(G);
    case 96: return pick_group<96>(G);
    case 128: return pick_group<128>(G);
    case 256: return pick_group<256>(G);  // Gemma 3
    default: return nullptr;
  }
}

}  // namespace

bool supports(int64_t head_dim, int64_t group) { return pick(head_dim, group) != nullptr; }

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor seq_lens, torch::Tensor rows,
                           int64_t page_size, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: contiguous q and caches");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32 &&
              rows.dtype() == torch::kInt64, "paged_decode: int32 tables and lens, int64 rows");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t G = Hq / Hkv;
  AttendFn fn = Hq % Hkv == 0 ? pick(D, G) : nullptr;
  TORCH_CHECK(fn != nullptr, "paged_decode: unsupported head size or group");
  auto tables_c = tables.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = tables_c.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t W = tables_c.size(1), row = Hkv * D;
  const float sc = static_cast<float>(scale);
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
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
  m.def("supports", &supports, "whether a head size and GQA group size are compiled in");
}
