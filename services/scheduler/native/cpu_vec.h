// Vector helpers the C++ CPU extensions share (included as "../cpu_vec.h"; native.py hashes
// the headers a source includes into its build's name, so an edit here rebuilds them all).
#pragma once

#include <cstdint>

namespace tokenline {

// exp16 and exp8's constants (Cephes' expf): x clamped to [kExpLo, kExpHi], n = round(x
// log2 e), r = x - n ln2 (ln2 in two parts), e^r by a degree-6 polynomial (kExpP, highest
// coefficient first, then 1 + r + r^2 p)
constexpr float kExpLo = -87.f, kExpHi = 80.f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace tokenline

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tokenline {

// e^x in float32 for x in [-87, 80] (clamped to it; a NaN stays NaN): Cephes' expf, a degree-6
// polynomial on r = x - n ln2 (ln2 in two parts), scaled by 2^n. About 1 ulp from the exact
// value, as glibc's expf is. Below -87 the result is e^-87, ~0 beside the e^0 of a softmax's
// max.
inline __m512 exp16(__m512 x) {
  // the constant first: min/max return their second operand when one is NaN
  x = _mm512_max_ps(_mm512_set1_ps(kExpLo), _mm512_min_ps(_mm512_set1_ps(kExpHi), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace tokenline

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace tokenline {

// e^x for 8 lanes (AVX2 + FMA, no AVX-512): exp16's polynomial, 2^n built in the exponent bits
// (n in [-126, 115] after the clamp: a normal float)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(kExpLo), _mm256_min_ps(_mm256_set1_ps(kExpHi), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 floats; or 8 bfloat16 (the high halves of float32s) widened exactly, by a shift
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

}  // namespace tokenline

#endif  // __AVX2__ && __FMA__
