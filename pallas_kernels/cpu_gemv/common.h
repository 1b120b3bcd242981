// Helpers shared by the native CPU kernels (gemv.cc, paged_attention.cc): loads of bf16 / f32 as f32 vectors,
// horizontal sums, and the layer of a stacked [L, ...] FFI buffer.
#ifndef JAXINFER_CPU_GEMV_COMMON_H_
#define JAXINFER_CPU_GEMV_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer_gemv {

// How far ahead of each weight stream the matmul kernels prefetch. 4 KiB over 2 KiB: SmolLM2's int4 / int8 layer
// calls streamed from DRAM 1.01-1.08x faster (BENCHMARKS.md, session 29); none prefetched: 0.71-0.80x.
constexpr int kPrefetchBytes = 4096;

// Loads of 8 values as f32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16: the upper half of an f32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// f32 -> bf16, rounding to nearest even (NaN stays a quiet NaN).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// The weight-only kernels' activation rounding (int8_nk, q4_nk): a row to int16 at absmax / 32767, nearest even.
// Returns 32767 / absmax (0 for an all-zero row or one holding NaN or inf) and sets `xs` to the row's scale (NaN
// for a non-finite row: its outputs are NaN, as its float products would not be finite).
inline float int16_inverse(const float* r, int64_t K, float& xs) {
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(3.4028235e38f);
  __m256 amax8 = _mm256_setzero_ps(), finite8 = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k));
    amax8 = _mm256_max_ps(amax8, a);
    finite8 = _mm256_and_ps(finite8, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for NaN and inf
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax8);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  bool finite = _mm256_movemask_ps(finite8) == 0xff;
  for (; k < K; ++k) {
    float a = __builtin_fabsf(r[k]);
    finite = finite && a <= 3.4028235e38f;
    amax = std::max(amax, a);
  }
  xs = finite ? amax / 32767.f : __builtin_nanf("");
  return finite && amax > 0.f ? 32767.f / amax : 0.f;
}
// 8 inputs times `inverse`, rounded to int32 in [-32767, 32767] (nearest even: the default MXCSR mode).
inline __m256i round_i16x8(const float* p, __m256 inverse) {
  const __m256 lim = _mm256_set1_ps(32767.f), nlim = _mm256_set1_ps(-32767.f);
  return _mm256_cvtps_epi32(_mm256_max_ps(nlim, _mm256_min_ps(lim, _mm256_mul_ps(_mm256_loadu_ps(p), inverse))));
}

// The avx512_vnni level (build.py's flags for it): 512-bit kernels and the VNNI dot products. One test for it, so
// every kernel switches on the same condition.
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define JAXINFER_AVX512_VNNI 1
#endif

// Integer dot-product steps into int32 lanes. With AVX-512 VNNI (and VL, for 256-bit vectors) each is one
// instruction (vpdpwssd, vpdpbusd); on AVX2 it is a multiply-add plus an add. Both are exact and wrap alike, so
// every ISA level gives the same bits.
inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {  // acc + (a[2j] * b[2j] + a[2j+1] * b[2j+1]), int16
#ifdef JAXINFER_AVX512_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
// acc + the sums of 4 adjacent products of unsigned bytes u and signed bytes s. On AVX2 (vpmaddubsw) the sums of
// pairs saturate at int16: the callers keep |u * s| pair sums below 2^15.
inline __m256i dot_u8i8(__m256i acc, __m256i u, __m256i s) {
#ifdef JAXINFER_AVX512_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#ifdef JAXINFER_AVX512_VNNI
// Four consecutive block scales, each broadcast over its 128-bit lane (the int4 kernels' 512-bit steps: four
// 32-input blocks a step, one a lane).
inline __m512 block_scales512(__m128 four) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
}
#endif

// exp(x) for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (expf, ~1 ulp),
// 2^n through the exponent bits. Lanes below ln(FLT_MIN) (-inf included) give 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f), hi = _mm256_set1_ps(88.3762626647949f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two for an exact product
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The element offset of layer `layer` (clamped into [0, L), as XLA clamps dynamic slices) in a stacked buffer.
inline int64_t layer_offset(const xla::ffi::AnyBuffer& b, const xla::ffi::Buffer<xla::ffi::S32>& layer) {
  int64_t num_layers = std::max<int64_t>(1, b.dimensions()[0]);
  int64_t l = std::min<int64_t>(std::max<int64_t>(0, layer.typed_data()[0]), num_layers - 1);
  return l * (b.element_count() / num_layers);
}

template <typename T>
const T* at_layer(const xla::ffi::AnyBuffer& b, const xla::ffi::Buffer<xla::ffi::S32>& layer) {
  return reinterpret_cast<const T*>(b.untyped_data()) + layer_offset(b, layer);
}

}  // namespace jaxinfer_gemv

#endif  // JAXINFER_CPU_GEMV_COMMON_H_
