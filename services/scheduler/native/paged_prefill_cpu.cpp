// Prefill and extend attention straight from the paged KV cache on CPU (float32 or bfloat16):
// flash-style tiles, the tiles a causal mask (or a sliding window) hides are never computed.
//
// torch's CPU SDPA spends most of a 128-512 token prefill outside its matmuls (50-80 GFLOP/s
// where this CPU's FMAs give several times that), and an extend (new tokens after a cached
// prefix) first gathers the prefix out of the cache and then runs SDPA with a mask, slower
// still. Here each task is one tile of LANES new tokens of one request for one KV head and the
// G query heads that share it; it walks the request's block table over the keys the tile can
// see, 32 keys at a time, with an online softmax:
//
//   q        [T, Hq, D]    new tokens packed back to back (token stride may exceed Hq * D)
//   k_cache  [S, Hkv, D]   position p of request b in slot tables[b, p / page] * page + p % page;
//   v_cache  [S, Hkv, D]   this step's k, v already written there (prefix and new tokens alike)
//   request b's new tokens are q[starts[b] : starts[b+1]], at positions [len - n, len), len =
//   seq_lens[b]; token at position p sees keys [0, p], or [p - window + 1, p] with a window
//
// One tile, queries along the vector lanes (so the softmax is lane-wise, no horizontal sums):
//
//   Qt [G][D] x LANES   the tile's queries, transposed once per tile
//   S  [32][G] x LANES  S[j][g] = q_g . k_j (each k_j element broadcast from the cache row)
//   O  [G][D] x LANES   O[g][d] = O * alpha + sum_j P[j][g] * v_j[d] (v_j[d] broadcast)
//
// Sums, the softmax and O are float32. bfloat16 with AVX512-BF16: the q.k dot products are
// _mm512_dpbf16_ps over pairs of d (a key row's pairs are its own 32-bit words; q is packed
// as pairs once per tile), and P @ V the same over pairs of keys (P rounded to bf16, as torch's
// flash kernel does, and the tile's value rows interleaved in pairs). Elsewhere (AVX2, or
// AVX-512 without BF16) one portable path does the float32 arithmetic on widened bf16 values;
// it is written with GCC vector types, 16 or 8 lanes as the CPU has them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENLINE_AVX512_BF16 1
#endif

namespace {

#if defined(__AVX512F__)
constexpr int LANES = 16;
constexpr int ACC = 24;  // accumulators a register block may hold (32 vector registers)
#else
constexpr int LANES = 8;
constexpr int ACC = 12;  // 16 registers
#endif

using vf = float __attribute__((vector_size(LANES * 4)));
using vi = int32_t __attribute__((vector_size(LANES * 4)));
using bf16 = uint16_t;  // bfloat16 storage: the high half of a float32

constexpr int BC = 32;  // keys per tile
constexpr float LOWEST = std::numeric_limits<float>::lowest();  // -ffast-math: no infinities

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float to_float(float x) { return x; }
inline float to_float(bf16 h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) {  // round to nearest even, as torch does (x is finite)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  *p = static_cast<bf16>(bits >> 16);
}

// 2^x for x <= 0 (cephes' exp2f polynomial on [-0.5, 0.5], relative error ~2e-7); below -126
// it gives 2^-126, which every caller multiplies by zero or adds to nothing that matters.
inline vf exp2v(vf x) {
  x = vmax(x, splat(-126.f));
  const vi n = __builtin_convertvector(x - 0.5f, vi);  // round to nearest: x - 0.5 < 0
  const vf f = x - __builtin_convertvector(n, vf);
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  return p * reinterpret_cast<vf>((n + 127) << 23);
}

constexpr int pow2_at_most(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// One tile's work: request b's new tokens [t0, t0 + LANES) (fewer at its end) for KV head h.
struct Task {
  int64_t b, h, t0, cost;
};

struct Step {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* starts;
  int64_t q_stride, Hq, Hkv, W, page;
  float scale_log2;  // scale * log2(e): the scores go to exp2
  int64_t window;
};

template <typename T, int D, int G>
struct Tile {
  static constexpr int KB = std::min(16, pow2_at_most(ACC / G));  // keys per QK block
  static constexpr int DB = std::min(16, pow2_at_most(ACC / G));  // d's per PV block
  static_assert(BC % KB == 0 && D % DB == 0);
#ifdef TOKENLINE_AVX512_BF16
  static constexpr bool kPairs = std::is_same_v<T, bf16>;  // dpbf16 for both products
#else
  static constexpr bool kPairs = false;
#endif
  static constexpr int NJ_STEP = kPairs ? std::max(2, KB) : KB;

  // per thread, reused by every task it runs
  std::vector<vf> qt = std::vector<vf>(G * D);  // float32 queries, or bf16 pairs (kPairs)
  std::vector<vf> o = std::vector<vf>(G * D);
  std::vector<vf> s = std::vector<vf>(BC * G);
  std::vector<vf> pairs = std::vector<vf>(BC / 2 * G);  // P as bf16 key pairs (kPairs)
  std::vector<uint32_t> vpairs = std::vector<uint32_t>(BC / 2 * D);  // value rows, paired
  vi valid[BC];
  const T* krow[BC];
  const T* vrow[BC];

  void run(const Step& st, const Task& task) {
    const int64_t b = task.b, h = task.h;
    const int64_t n = st.starts[b + 1] - st.starts[b], len = st.seq_lens[b];
    const int64_t nv = std::min<int64_t>(LANES, n - task.t0);  // valid lanes
    const int64_t tok0 = st.starts[b] + task.t0, pos0 = len - n + task.t0, last = pos0 + nv - 1;
    const int64_t kbegin = st.window > 0 ? std::max<int64_t>(0, pos0 - st.window + 1) : 0;
    const int32_t* table = st.tables + b * st.W;
    const int64_t row = st.Hkv * D;
    const T* kc = static_cast<const T*>(st.k_cache) + h * D;
    const T* vc = static_cast<const T*>(st.v_cache) + h * D;

    pack_queries(static_cast<const T*>(st.q) + tok0 * st.q_stride + h * G * D, st.q_stride, nv);
    vi qpos;
    for (int l = 0; l < LANES; ++l) qpos[l] = static_cast<int32_t>(pos0 + std::min<int64_t>(l, nv - 1));
    vf m[G], lsum[G];
    for (int g = 0; g < G; ++g) m[g] = splat(LOWEST), lsum[g] = splat(0.f);
    for (int i = 0; i < G * D; ++i) o[i] = splat(0.f);

    for (int64_t k0 = kbegin; k0 <= last; k0 += BC) {
      const int nk = static_cast<int>(std::min<int64_t>(BC, last + 1 - k0));
      const int nj = (nk + NJ_STEP - 1) / NJ_STEP * NJ_STEP;  // rows past nk: masked
      for (int j = 0; j < nj; ++j) {
        const int64_t p = k0 + std::min(j, nk - 1);
        const int64_t slot = static_cast<int64_t>(table[p / st.page]) * st.page + p % st.page;
        krow[j] = kc + slot * row;
        vrow[j] = vc + slot * row;
      }
      scores(nj, st.scale_log2);
      // keys past the tile's first query (the diagonal, and rows past nk), or before the
      // window of its last one, are hidden from some lanes
      const bool masked = k0 + nj - 1 > pos0 ||
                          (st.window > 0 && k0 < last - st.window + 1);
      if (masked) {
        for (int j = 0; j < nj; ++j) {
          const vi key = vi{} + static_cast<int32_t>(k0 + j);
          vi ok = key <= qpos;
          if (st.window > 0) ok &= key > qpos - static_cast<int32_t>(st.window);
          valid[j] = ok;
        }
      }
      vf alpha[G];
      for (int g = 0; g < G; ++g) {
        vf mx = m[g];
        for (int j = 0; j < nj; ++j) {
          vf& x = s[j * G + g];
          if (masked) x = valid[j] ? x : splat(LOWEST);
          mx = vmax(mx, x);
        }
        alpha[g] = exp2v(m[g] - mx);
        m[g] = mx;
        vf sum = splat(0.f);
        for (int j = 0; j < nj; ++j) {
          vf p = exp2v(s[j * G + g] - mx);
          if (masked) p = valid[j] ? p : splat(0.f);
          s[j * G + g] = p;
          sum += p;
        }
        lsum[g] = lsum[g] * alpha[g] + sum;
      }
      accumulate(nj, alpha);
    }
    // normalized in place, then written out token by token (o as floats: [G][D][LANES])
    for (int g = 0; g < G; ++g) {
      const vf inv = 1.f / lsum[g];
      for (int d = 0; d < D; ++d) o[g * D + d] *= inv;
    }
    const float* of = reinterpret_cast<const float*>(o.data());
    T* out = static_cast<T*>(st.out) + tok0 * st.Hq * D + h * G * D;
    for (int l = 0; l < nv; ++l)
      for (int i = 0; i < G * D; ++i) store(out + l * st.Hq * D + i, of[i * LANES + l]);
  }

  // qt[g][d] lane l = query token l's head g, element d (lanes past nv repeat the last token)
  void pack_queries(const T* q, int64_t stride, int64_t nv) {
    if constexpr (kPairs) {
      auto* words = reinterpret_cast<uint32_t*>(qt.data());  // [G][D/2] x LANES bf16 pairs
      for (int l = 0; l < LANES; ++l) {
        const auto* src = reinterpret_cast<const uint32_t*>(q + std::min<int64_t>(l, nv - 1) * stride);
        for (int i = 0; i < G * D / 2; ++i) words[i * LANES + l] = src[i];
      }
    } else {
      float* dst = reinterpret_cast<float*>(qt.data());  // [G][D] x LANES floats
      for (int l = 0; l < LANES; ++l) {
        const T* src = q + std::min<int64_t>(l, nv - 1) * stride;
        for (int i = 0; i < G * D; ++i) dst[i * LANES + l] = to_float(src[i]);
      }
    }
  }

  // s[j][g] = q_g . k_j * scale_log2 for the tile's rows j < nj
  void scores(int nj, float scale_log2) {
    for (int j0 = 0; j0 < nj; j0 += KB) {
      vf acc[KB][G];
#pragma GCC unroll 16
      for (int kb = 0; kb < KB; ++kb)
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) acc[kb][g] = splat(0.f);
      if constexpr (kPairs) {
#ifdef TOKENLINE_AVX512_BF16
        for (int dp = 0; dp < D / 2; ++dp) {
          __m512bh qv[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) qv[g] = reinterpret_cast<__m512bh>(qt[g * D / 2 + dp]);
#pragma GCC unroll 16
          for (int kb = 0; kb < KB; ++kb) {
            int32_t word;
            std::memcpy(&word, krow[j0 + kb] + 2 * dp, sizeof word);
            const auto kv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g)
              acc[kb][g] = reinterpret_cast<vf>(
                  _mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[kb][g]), qv[g], kv));
          }
        }
#endif
      } else {
        for (int d = 0; d < D; ++d) {
          vf qv[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) qv[g] = qt[g * D + d];
#pragma GCC unroll 16
          for (int kb = 0; kb < KB; ++kb) {
            const vf kv = splat(to_float(krow[j0 + kb][d]));
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) acc[kb][g] += kv * qv[g];
          }
        }
      }
#pragma GCC unroll 16
      for (int kb = 0; kb < KB; ++kb)
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) s[(j0 + kb) * G + g] = acc[kb][g] * scale_log2;
    }
  }

  // o[g][d] = o[g][d] * alpha[g] + sum_j s[j][g] * v_j[d] (s holds the probabilities now)
  void accumulate(int nj, const vf* alpha) {
    if constexpr (kPairs) {
#ifdef TOKENLINE_AVX512_BF16
      alignas(64) static const uint16_t interleave[32] = {
          0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      const __m512i idx = _mm512_load_si512(interleave);
      for (int jp = 0; jp < nj / 2; ++jp) {
        for (int g = 0; g < G; ++g) {
          const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
              reinterpret_cast<__m512>(s[(2 * jp + 1) * G + g]),
              reinterpret_cast<__m512>(s[2 * jp * G + g])));
          pairs[jp * G + g] = reinterpret_cast<vf>(_mm512_permutexvar_epi16(idx, both));
        }
        const bf16* v0 = vrow[2 * jp];
        const bf16* v1 = vrow[2 * jp + 1];
        uint32_t* dst = vpairs.data() + jp * D;
        for (int d = 0; d < D; ++d) dst[d] = v0[d] | static_cast<uint32_t>(v1[d]) << 16;
      }
      for (int d0 = 0; d0 < D; d0 += DB) {
        __m512 acc[DB][G];
#pragma GCC unroll 16
        for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
            acc[dd][g] = reinterpret_cast<__m512>(o[g * D + d0 + dd] * alpha[g]);
        for (int jp = 0; jp < nj / 2; ++jp) {
          __m512bh pv[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) pv[g] = reinterpret_cast<__m512bh>(pairs[jp * G + g]);
#pragma GCC unroll 16
          for (int dd = 0; dd < DB; ++dd) {
            const auto vv = reinterpret_cast<__m512bh>(
                _mm512_set1_epi32(static_cast<int32_t>(vpairs[jp * D + d0 + dd])));
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) acc[dd][g] = _mm512_dpbf16_ps(acc[dd][g], pv[g], vv);
          }
        }
#pragma GCC unroll 16
        for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) o[g * D + d0 + dd] = reinterpret_cast<vf>(acc[dd][g]);
      }
#endif
    } else {
      for (int d0 = 0; d0 < D; d0 += DB) {
        vf acc[DB][G];
#pragma GCC unroll 16
        for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) acc[dd][g] = o[g * D + d0 + dd] * alpha[g];
        for (int j = 0; j < nj; ++j) {
          vf pv[G];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) pv[g] = s[j * G + g];
          const T* vr = vrow[j] + d0;
#pragma GCC unroll 16
          for (int dd = 0; dd < DB; ++dd) {
            const vf vv = splat(to_float(vr[dd]));
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) acc[dd][g] += vv * pv[g];
          }
        }
#pragma GCC unroll 16
        for (int dd = 0; dd < DB; ++dd)
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) o[g * D + d0 + dd] = acc[dd][g];
      }
    }
  }
};

// Every thread takes the next task (costliest first) until none is left: causal tiles differ
// in cost by up to the sequence length, so a static split would leave a thread idle.
template <typename T, int D, int G>
void run_tasks(const Step& st, const std::vector<Task>& tasks) {
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Tile<T, D, G> tile;
    for (size_t i = next++; i < tasks.size(); i = next++) tile.run(st, tasks[i]);
  });
}

template <typename T>
using RunFn = void (*)(const Step&, const std::vector<Task>&);

template <typename T, int D>
RunFn<T> pick_group(int64_t G) {
  switch (G) {
    case 1: return run_tasks<T, D, 1>;
    case 2: return run_tasks<T, D, 2>;
    case 3: return run_tasks<T, D, 3>;
    case 4: return run_tasks<T, D, 4>;
    case 5: return run_tasks<T, D, 5>;
    case 6: return run_tasks<T, D, 6>;
    case 7: return run_tasks<T, D, 7>;
    case 8: return run_tasks<T, D, 8>;
    default: return nullptr;
  }
}

template <typename T>
RunFn<T> pick(int64_t D, int64_t G) {
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

}  // namespace

bool supports(int64_t head_dim, int64_t group) {
  return pick<float>(head_dim, group) != nullptr && pick<bf16>(head_dim, group) != nullptr;
}

#ifdef TOKENLINE_AVX512_BF16
bool fast_bf16() { return true; }
#else
bool fast_bf16() { return false; }
#endif

// Attention for the new tokens of the requests in `rows` (any number of new tokens each),
// written into their rows of `out`; other rows of `out` are left as they are.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor tables, torch::Tensor seq_lens, torch::Tensor starts,
                   torch::Tensor rows, int64_t page_size, double scale, int64_t window,
                   torch::Tensor out) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
              k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
              out.scalar_type() == dtype,
              "paged_prefill: q, caches and out all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_prefill: q [T, Hq, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
              out.sizes() == q.sizes(), "paged_prefill: contiguous caches and out like q");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32 &&
              starts.dtype() == torch::kInt32 && rows.dtype() == torch::kInt64,
              "paged_prefill: int32 tables, lens and starts, int64 rows");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && pick<float>(D, Hq / Hkv) != nullptr,
              "paged_prefill: unsupported head size or group");
  auto tables_c = tables.contiguous();
  auto lens_c = seq_lens.contiguous();
  auto starts_c = starts.contiguous();
  auto rows_c = rows.contiguous();
  const int32_t* sp = starts_c.data_ptr<int32_t>();
  const int32_t* lp = lens_c.data_ptr<int32_t>();
  std::vector<Task> tasks;
  for (int64_t i = 0; i < rows_c.numel(); ++i) {
    const int64_t b = rows_c.data_ptr<int64_t>()[i];
    const int64_t n = sp[b + 1] - sp[b], len = lp[b];
    TORCH_CHECK(n >= 1 && n <= len, "paged_prefill: a request's new tokens exceed its length");
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
      const int64_t last = len - n + std::min<int64_t>(n, t0 + LANES) - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - n + t0 - window + 1) : 0;
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, t0, last + 1 - first});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const Step st{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                tables_c.data_ptr<int32_t>(), lp, sp, q.stride(0), Hq, Hkv, tables_c.size(1),
                page_size, static_cast<float>(scale * 1.4426950408889634), window};
  if (dtype == torch::kFloat32) pick<float>(D, Hq / Hkv)(st, tasks);
  else pick<bf16>(D, Hq / Hkv)(st, tasks);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill,
        "prefill/extend attention over a paged KV cache (float32 or bfloat16, CPU)");
  m.def("supports", &supports, "whether a head size and GQA group size are compiled in");
  m.def("fast_bf16", &fast_bf16, "whether the bfloat16 kernel uses AVX512-BF16 dot products");
}
