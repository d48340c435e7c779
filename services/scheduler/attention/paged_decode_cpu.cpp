// Decode attention straight from the paged KV cache on CPU (float32 or bfloat16): the step's
// new K/V rows written into the cache and every decode row attended to, in one call per layer.
//
// The torch path gathers each request's blocks into a padded copy, then runs SDPA over the
// copy: the cache is read, written and read again. Here the cache is read once, a block at a
// time: a block holds page_size rows of all KV heads side by side (page * Hkv * D values, one
// contiguous span), so each block comes from memory once (prefetched while the one before it
// is read) and then serves every query head of the request from L1.
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
// to bf16 once, to nearest even. Elsewhere (AVX2, or AVX512 without BF16) a portable path does
// the same arithmetic in scalar code the compiler vectorizes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TOKENLINE_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TOKENLINE_AVX512_BF16 1
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
  float* m;    // [G] max score
  float* l;    // [G] sum of e^(s - m)
  float* acc;  // [G * D] sum of e^(s - m) v
};

// Folds a tile's scores s[g][0..n) into the running max and sum: s becomes e^(s - m), and the
// factor by which acc must shrink (its old max was lower) is returned in scale_acc[g].
template <int G>
inline void softmax_tile(float (&s)[G][kTile], int n, const Running& r, float* scale_acc) {
  for (int g = 0; g < G; ++g) {
    float mx = r.m[g];
    for (int j = 0; j < n; ++j) mx = std::max(mx, s[g][j]);
    scale_acc[g] = mx == r.m[g] ? 1.f : r.m[g] == kNoMax ? 0.f : std::exp(r.m[g] - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // a vector exp (libmvec)
    for (int j = 0; j < n; ++j) {
      s[g][j] = std::exp(s[g][j] - mx);
      sum += s[g][j];
    }
    r.l[g] = r.l[g] * scale_acc[g] + sum;
    r.m[g] = mx;
  }
}

// The G query heads that share one KV head, and one tile of rows folded into their softmax.
// Portable: q widened to float32, plain loops for the compiler to vectorize.
template <typename T, int D, int G>
struct Heads {
  float q[G][D];

  void load(const T* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) q[g][d] = widen(src[g * head_stride + d]);
  }

  // rows k0, k0 + row, ... (n <= kTile of them) and the same rows of v
  void tile(const T* __restrict k0, const T* __restrict v0, int64_t row, int n, float scale,
            const Running& r) const {
    float s[G][kTile];
    for (int j = 0; j < n; ++j) {
      const T* __restrict kr = k0 + j * row;
      float dots[G];
      for (int g = 0; g < G; ++g) dots[g] = 0.f;
      for (int d = 0; d < D; ++d) {
        const float x = widen(kr[d]);
        for (int g = 0; g < G; ++g) dots[g] += q[g][d] * x;
      }
      for (int g = 0; g < G; ++g) s[g][j] = dots[g] * scale;
    }
    float shrink[G];
    softmax_tile<G>(s, n, r, shrink);
    float* __restrict acc = r.acc;
    for (int g = 0; g < G; ++g)
      if (shrink[g] != 1.f)
        for (int d = 0; d < D; ++d) acc[g * D + d] *= shrink[g];
    for (int j = 0; j < n; ++j) {
      const T* __restrict vr = v0 + j * row;
      float vf[D];
      for (int d = 0; d < D; ++d) vf[d] = widen(vr[d]);
      for (int g = 0; g < G; ++g) {
        const float w = s[g][j];
        for (int d = 0; d < D; ++d) acc[g * D + d] += w * vf[d];
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

// e^x for x <= 0 (Cephes' expf: a degree-6 polynomial on x - n ln2, then a scale by 2^n);
// below -87 the result is taken as e^-87, which a caller masks or which is ~0 beside e^0
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The softmax and value half of a tile, shared by float32 and bfloat16: `parts[g][j]` are row
// j's products for head g; `value(j, c)` loads chunk c of value row j as float32.
template <int D, int G, typename Value>
inline void fold_tile(__m512 (&parts)[G][kTile], int n, float scale, const Running& r,
                      Value&& value) {
  constexpr int V = D / 16;
  const __mmask16 live = n >= kTile ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  alignas(64) float p[G][kTile];
  float shrink[G];
  for (int g = 0; g < G; ++g) {
    for (int j = n; j < kTile; ++j) parts[g][j] = _mm512_setzero_ps();
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNoMax), live,
                                        _mm512_mul_ps(sum_lanes16(parts[g]),
                                                      _mm512_set1_ps(scale)));
    const float mx = std::max(r.m[g], _mm512_reduce_max_ps(s));
    shrink[g] = mx == r.m[g] ? 1.f : r.m[g] == kNoMax ? 0.f : std::exp(r.m[g] - mx);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
    r.l[g] = r.l[g] * shrink[g] + _mm512_reduce_add_ps(e);
    r.m[g] = mx;
    _mm512_store_ps(p[g], e);
  }
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c)
      acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(r.acc + g * D + c * 16),
                                _mm512_set1_ps(shrink[g]));
  for (int j = 0; j < n; ++j)
    for (int c = 0; c < V; ++c) {
      const __m512 x = value(j, c);
      for (int g = 0; g < G; ++g)
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][j]), x, acc[g][c]);
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(r.acc + g * D + c * 16, acc[g][c]);
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

  void tile(const float* __restrict k0, const float* __restrict v0, int64_t row, int n,
            float scale, const Running& r) const {
    __m512 parts[G][kTile];
    for (int j = 0; j < n; ++j) {
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(k0 + j * row + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(q[g][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(q[g][c], kv[c], a);
        parts[g][j] = a;
      }
    }
    fold_tile<D, G>(parts, n, scale, r, [&](int j, int c) {
      return _mm512_loadu_ps(v0 + j * row + c * 16);
    });
  }
};

#endif  // TOKENLINE_AVX512

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
struct Heads<uint16_t, D, G> {
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  static constexpr int C = (D + 31) / 32;  // 32-wide chunks of a row for the dots
  __m512bh q[G][C];

  void load(const uint16_t* src, int64_t head_stride) {
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) q[g][c] = load_pairs<D>(src + g * head_stride, c * 32);
  }

  void tile(const uint16_t* __restrict k0, const uint16_t* __restrict v0, int64_t row, int n,
            float scale, const Running& r) const {
    __m512 parts[G][kTile];
    for (int j = 0; j < n; ++j) {
      __m512bh kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_pairs<D>(k0 + j * row, c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, q[g][c], kv[c]);
        parts[g][j] = a;
      }
    }
    fold_tile<D, G>(parts, n, scale, r, [&](int j, int c) {
      return load_wide(v0 + j * row + c * 16);
    });
  }
};

constexpr bool kFastBf16 = true;
#else
constexpr bool kFastBf16 = false;
#endif  // TOKENLINE_AVX512_BF16

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask
// for a share of a coming block's rows (all heads: one contiguous span) with each head of
// this one.
// How far ahead to prefetch: 16 KiB, one float32 block of SmolLM2's (16 rows, 3 KV heads of
// 64) or two bfloat16 ones; on the shared 2-core machine 12-24 KiB measured alike, within noise.
constexpr int64_t kPrefetchBytes = 16384;

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// Positions [t0, t1) of one request, every head: tiles of each block folded into `r` (the
// request's Hq heads, kv head h's G of them at r.m + h * G, ...).
template <typename T, int D, int G>
void attend_piece(const T* q, int64_t q_head_stride, const T* kc, const T* vc,
                  const int32_t* __restrict table, int64_t t0, int64_t t1, int64_t page,
                  int64_t Hkv, float scale, const Running& r) {
  const int64_t row = Hkv * D;
  const int64_t ahead = std::clamp<int64_t>(kPrefetchBytes / (page * row * sizeof(T)), 1, 8);
  for (int64_t blk = t0 / page; blk * page < t1; ++blk) {
    const int64_t b0 = blk * page;
    const int64_t lo = std::max(t0, b0) - b0, hi = std::min(t1, b0 + page) - b0;
    const int64_t base = static_cast<int64_t>(table[blk]) * page * row;
    const T* kb = kc + base;
    const T* vb = vc + base;
    // the block `ahead` of this one, if the piece reaches it: rows needed, each head's share
    const int64_t coming = std::min(page, t1 - b0 - ahead * page);
    const int64_t share = coming > 0 ? (coming * row * sizeof(T) + Hkv - 1) / Hkv : 0;
    const int64_t next = coming > 0 ? static_cast<int64_t>(table[blk + ahead]) * page * row : 0;
    const char* kn = reinterpret_cast<const char*>(kc + next);
    const char* vn = reinterpret_cast<const char*>(vc + next);
    for (int64_t h = 0; h < Hkv; ++h) {
      if (share) {
        prefetch_span(kn + h * share, share);
        prefetch_span(vn + h * share, share);
      }
      const Running rh{r.m + h * G, r.l + h * G, r.acc + h * G * D};
      // reloaded per block: from L1, and it leaves the registers to the tile
      Heads<T, D, G> heads;
      heads.load(q + h * G * q_head_stride, q_head_stride);
      for (int64_t j = lo; j < hi; j += kTile)
        heads.tile(kb + j * row + h * D, vb + j * row + h * D, row,
                   static_cast<int>(std::min<int64_t>(kTile, hi - j)), scale, rh);
    }
  }
}

template <typename T>
using PieceFn = void (*)(const T*, int64_t, const T*, const T*, const int32_t*, int64_t,
                         int64_t, int64_t, int64_t, float, const Running&);

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

// K and V bytes below which a step runs on one thread (1 MiB: SmolLM2's 680 float32 positions,
// 1,365 bfloat16; split over two cores, 1,024 float32 positions were already about even)
constexpr int64_t kSerialBytes = int64_t{1} << 20;

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
  // A small step runs on the calling thread: waking a sleeping OpenMP thread (the passive wait
  // policy) costs 15-20 us, more than a batch-1 step at a context of 256 takes on one core
  // (SmolLM2, float32: 14 us alone against 34 us split over two).
  const bool small = total * s.Hkv * D * static_cast<int64_t>(sizeof(T)) * 2 < kSerialBytes;
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

  auto work = [&](int64_t, int64_t) {
    std::vector<float> mine(static_cast<size_t>(stride));
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      const Piece& pc = pieces[i];
      float* base = pc.part < 0 ? mine.data() : partial.data() + pc.part * stride;
      const Running r{base + Hq * D, base + Hq * D + Hq, base};
      std::fill(r.acc, r.acc + Hq * D, 0.f);
      std::fill(r.m, r.m + Hq, kNoMax);
      std::fill(r.l, r.l + Hq, 0.f);
      const int64_t b = request(pc.n);
      fn(q + token(pc.n) * s.q_s0, s.q_s1, kc, vc, s.tables + b * s.W, pc.t0, pc.t1, s.page,
         s.Hkv, s.scale, r);
      if (pc.part < 0)
        write_out(out + token(pc.n) * Hq * D, r.acc, r.l, Hq, D);
      else if (left[pc.n].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge(pc.n);  // the row's last piece: every other one is in `partial` by now
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
}
