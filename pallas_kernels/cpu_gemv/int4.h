// The packed int4 kernels of gemv.cc (weights uint8 [N, K / 2], two 4-bit codes per byte, input 2j in the low
// nibble of byte j): q4_nk, int16 activations (weight-only: the activations' rounding is finer than bf16), and
// q4a8_nk, int8 activations per block of 32 inputs (w4a8: GGUF Q4_0 x Q8_0, llama.cpp's CPU arithmetic).
#ifndef JAXINFER_CPU_GEMV_INT4_H_
#define JAXINFER_CPU_GEMV_INT4_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace jaxinfer_gemv {

// Bytes of 32 consecutive inputs (q[0..3]: int32, inputs in order, each in the byte range) split by parity: the 16
// even inputs to `even`, the 16 odd ones to `odd` (as the codes' low and high nibbles fall). Signed bytes, or
// unsigned with `as_unsigned`.
inline void store_even_odd(const __m256i q[4], bool as_unsigned, void* even, void* odd) {
  __m256i w0 = _mm256_packs_epi32(q[0], q[1]), w1 = _mm256_packs_epi32(q[2], q[3]);
  // packs interleave 128-bit lanes: bytes [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31] in 32-bit groups
  __m256i bytes = as_unsigned ? _mm256_packus_epi16(w0, w1) : _mm256_packs_epi16(w0, w1);
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // inputs 0..31 in order
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xd8);  // [16 evens | 16 odds]
  _mm_storeu_si128(static_cast<__m128i*>(even), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(static_cast<__m128i*>(odd), _mm256_extracti128_si256(bytes, 1));
}

// The scale index of each 32-input block in turn, from block `first` on: groups of K / G inputs (one or several
// blocks; an odd count lets a 64-input chunk straddle two groups). No division in the loop: a runtime divide costs
// more than a chunk's work.
struct BlockGroups {
  int64_t per, group, in_group;
  BlockGroups(int64_t K, int64_t G, int64_t first) : per(K / G / 32), group(first / per), in_group(first % per) {}
  int64_t next() {
    int64_t g = group;
    if (++in_group == per) in_group = 0, ++group;
    return g;
  }
};

// Codes with a min: sum over the row's G groups of min x the group's rounded activation sum.
inline float min_correction(const float* mins, const float* xsum, int64_t G) {
  __m256 c8 = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) c8 = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xsum + g), c8);
  float corr = hsum(c8);
  for (; g < G; ++g) corr += mins[g] * xsum[g];
  return corr;
}

// q4_nk, byte-split (every level at one row and K <= 1024, `q4_byte_split`; all shapes at avx512_vnni): codes
// times activations rounded to int16 per row (`int16_inverse`), exactly.
// Each int16 input is split as x = 256 h + l (h its signed high byte, l its unsigned low byte), so the codes
// multiply bytes: the unsigned codes times h and the unsigned l times the codes (0..15 as signed bytes) by
// vpdpbusd, and a block's sum is 256 x the first plus the second (four byte dots, a shift and an add for 128
// inputs, where widening the codes to int16 took ~6 more instructions: 1.01-1.17x faster at SmolLM2's shapes).
// At avx2 the byte dots are vpmaddubsw pairs added by vpmaddwd (the same int32 sums); there they took 1.2-1.3x the
// int16 form's time (below) at two or more activation rows, 0.89-0.93x at one row of K <= 1024 (session 29). The activations are laid out once a call as A8Pair's (`I16Pair`): per 128-input span, each
// field's byte 32 h + j holds input 2j (even fields) or 2j + 1 (odd fields) of the span's chunk h, as byte j of the
// chunk's codes holds them in its low and high nibble, so each 32-input block sits in its own 128-bit lane, beside
// its weight scale. Symmetric codes (w = s * (c - 8)) take the 8 off through `offset`, where each block's int32 sums
// start (-2 x the block's rounded input sum in each of its 4 lanes); codes with a min add min x (the rounded
// inputs' group sum) per group at the row's end. The row's activation scale is applied by the caller.
struct I16Pair {
  int8_t h_even[64], h_odd[64];   // high bytes of chunk h's inputs 2j and 2j + 1 at [32 h + j]
  uint8_t l_even[64], l_odd[64];  // their low bytes
  int32_t offset[16];             // [8 h + 4 b + i]: symmetric codes: -2 x the rounded sum of chunk h's block b
};

// Rows x [M, K] (K a multiple of 64) rounded as `int16_inverse` into I16Pair [M, ceil(K / 128)] (an odd last chunk
// fills half a pair), `xs` [M] the rows' scales, `xsum` [M, G] the rounded rows' sums per group of K / G inputs
// (K / G a multiple of 32).
inline std::vector<I16Pair> q4_activations(const float* x, int64_t M, int64_t K, bool symmetric, int64_t G,
                                      std::vector<float>& xs, std::vector<float>& xsum) {
  const int64_t P = (K + 127) / 128, group = K / G;
  std::vector<I16Pair> out(M * P);
  xs.resize(M);
  xsum.assign(M * G, 0.f);
  const __m256i low8 = _mm256_set1_epi32(0xff);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    const __m256 inverse = _mm256_set1_ps(int16_inverse(r, K, xs[m]));
    for (int64_t k = 0; k < K; k += 32) {  // a block: chunk c = k / 64, its block b, in pair c / 2 at half h
      I16Pair& pair = out[m * P + k / 128];
      const int64_t h = (k >> 6) & 1, b = (k >> 5) & 1, at = 32 * h + 16 * b;
      __m256i q[4], hi[4], lo[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = round_i16x8(r + k + 8 * i, inverse);
        hi[i] = _mm256_srai_epi32(q[i], 8), lo[i] = _mm256_and_si256(q[i], low8);
      }
      store_even_odd(hi, false, pair.h_even + at, pair.h_odd + at);
      store_even_odd(lo, true, pair.l_even + at, pair.l_odd + at);
      int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      for (int i = 0; i < 4; ++i) pair.offset[8 * h + 4 * b + i] = symmetric ? -2 * sum : 0;
      xsum[m * G + k / group] += float(sum);
    }
  }
  return out;
}

// The int32 sums of one 256-bit step: the unsigned codes lo (even inputs) and hi (odd ones) times the inputs
// 256 h + l of `x`'s half `half`, added to the offsets there.
inline __m256i q4_dot(__m256i lo, __m256i hi, const I16Pair& x, int64_t half) {
  auto load = [&](const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  __m256i he = load(x.h_even + 32 * half), ho = load(x.h_odd + 32 * half);
  __m256i le = load(x.l_even + 32 * half), lodd = load(x.l_odd + 32 * half), start = load(x.offset + 8 * half);
#ifdef JAXINFER_AVX512_VNNI
  __m256i dh = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, he), hi, ho);
  __m256i dl = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, le, lo), lodd, hi);
#else  // byte pairs into int16 (at most 2 x 15 x 128 and 2 x 255 x 15: no saturation), then into int32 lanes
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i dh = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, he), _mm256_maddubs_epi16(hi, ho)), ones);
  __m256i dl = _mm256_add_epi32(start, _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(le, lo), _mm256_maddubs_epi16(lodd, hi)), ones));
#endif
  return _mm256_add_epi32(_mm256_slli_epi32(dh, 8), dl);
}

// MG activation rows by NR weight rows (MG = 1 with NR = 2 or 4, or NR = 1): each chunk's activations are shared
// by the NR weight rows, and the per-row end (horizontal sums) is spread over NR rows' work. Chunks [c0, K / 64)
// in 256-bit steps; `sums` (when given, [NR][MG]): the earlier chunks' sums (q4_block512's), in the same units.
template <int MG, int NR, bool kBlockScales, bool kSymmetric>
void q4_block(const I16Pair* xp, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
              const float* offset, int64_t G, float* y, int64_t N, int64_t n, int64_t m0, int64_t c0 = 0,
              const float* sums = nullptr) {
  constexpr int kChains = NR == 1 ? 2 : 1;  // one weight row: two chains (even and odd chunks), half the FMA latency
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const int64_t P = (K + 127) / 128;
  __m256 acc[kChains][NR][MG];
  for (int h = 0; h < kChains; ++h)
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < MG; ++i) acc[h][r][i] = _mm256_setzero_ps();
  BlockGroups groups(K, G, 2 * c0);
  for (int64_t c = c0; c < K / 64; ++c) {
    const int64_t g0 = kBlockScales ? 2 * c : groups.next(), g1 = kBlockScales ? 2 * c + 1 : groups.next();
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + (n + r) * (K / 2) + 32 * c;
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const float* ws = scale + (n + r) * G;
      __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(ws + g0)), _mm_broadcast_ss(ws + g1), 1);
      for (int i = 0; i < MG; ++i) {
        __m256i b = q4_dot(lo, hi, xp[(m0 + i) * P + c / 2], c & 1);
        __m256& a = acc[kChains == 2 ? (c & 1) : 0][r][i];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), sv, a);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MG; ++i) {
      __m256 a = acc[0][r][i];
      if (kChains == 2) a = _mm256_add_ps(a, acc[kChains - 1][r][i]);
      float total = hsum(a) + (sums ? sums[r * MG + i] : 0.f);
      if (!kSymmetric) total += min_correction(offset + (n + r) * G, xsum + (m0 + i) * G, G);
      y[(m0 + i) * N + n + r] = total;  // the row's activation scale: by the caller
    }
}

// q4_nk in 512-bit steps: 128 inputs (a cache line of codes, four blocks, one a 128-bit lane) a step. An odd last
// chunk and the per-row end go to q4_block.
#ifdef JAXINFER_AVX512_VNNI
template <int MG, int NR, bool kBlockScales, bool kSymmetric>
void q4_block512(const I16Pair* xp, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
                 const float* offset, int64_t G, float* y, int64_t N, int64_t n, int64_t m0) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t S = K / 128, P = (K + 127) / 128;
  __m512 acc[NR][MG];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MG; ++i) acc[r][i] = _mm512_setzero_ps();
  BlockGroups groups(K, G, 0);
  for (int64_t s = 0; s < S; ++s) {
    __m512i lo[NR], hi[NR];
    __m512 ws[NR];
    int64_t g[4];
    for (int b = 0; b < 4; ++b) g[b] = kBlockScales ? 4 * s + b : groups.next();
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + (n + r) * (K / 2) + 64 * s;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m512i v = _mm512_loadu_si512(row);
      lo[r] = _mm512_and_si512(v, low4), hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const float* sr = scale + (n + r) * G;
      ws[r] = block_scales512(kBlockScales ? _mm_loadu_ps(sr + 4 * s) : _mm_setr_ps(sr[g[0]], sr[g[1]], sr[g[2]], sr[g[3]]));
    }
    for (int i = 0; i < MG; ++i) {
      const I16Pair& x = xp[(m0 + i) * P + s];
      __m512i he = _mm512_loadu_si512(x.h_even), ho = _mm512_loadu_si512(x.h_odd);
      __m512i le = _mm512_loadu_si512(x.l_even), lodd = _mm512_loadu_si512(x.l_odd);
      __m512i start = _mm512_loadu_si512(x.offset);
      for (int r = 0; r < NR; ++r) {
        __m512i dh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], he), hi[r], ho);
        __m512i dl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, le, lo[r]), lodd, hi[r]);
        __m512i b = _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), ws[r], acc[r][i]);
      }
    }
  }
  float sums[NR * MG];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MG; ++i) sums[r * MG + i] = _mm512_reduce_add_ps(acc[r][i]);
  q4_block<MG, NR, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m0, 2 * S, sums);
}
#endif  // JAXINFER_AVX512_VNNI (q4_block512)

#ifndef JAXINFER_AVX512_VNNI  // the avx2 level's int16 layout
// q4_nk at the avx2 level: 64 inputs (32 bytes of codes) per step. Byte j holds input 2j in its low nibble and
// 2j + 1 in its high one. Each nibble set is widened to int16 in place within its 128-bit lane (vpunpck{l,h}bw
// with zero as the low byte, so a code c arrives as c * 256: one instruction per 16 codes, no lane crossing),
// which puts the chunk's first 32-input block in the low lanes and its second in the high lanes; the caller lays
// out each 64-input chunk of the int16 activations in that order (`q4_position`). vpmaddwd multiplies the codes
// exactly with the activations; each block's int32 sums are scaled by its weight scale into the f32 totals (in
// units of the row's activation scale / 256, applied by the caller). Symmetric codes subtract their 8 as bytes
// before widening; asymmetric ones add min * (the rounded activations' group sums) per group at the end.
inline int64_t q4_position(int64_t k, int64_t K) {  // where input k of a row of K goes in the activations' q4 layout
  int64_t j = (k & 63) >> 1, byte = j & 15;
  int64_t p = ((k & 1) * 2 + (byte >> 3)) * 16 + (j >> 4) * 8 + (byte & 7);  // within its 64-input chunk
  return (k & ~int64_t(63)) + p;
}

// One row of int32 values (|v| <= 32767, K a multiple of 64) into int16 in the q4 layout: per 64-input chunk, the
// eight runs of 8 outputs take inputs s, s + 2, ..., s + 14 for s = 0, 32, 16, 48 (even) and 1, 33, 17, 49 (odd),
// each run stored where `q4_position` puts its first input. 16 inputs at a time: evens and odds split by permutes.
inline void q4_layout_row(const int32_t* natural, int64_t K, int16_t* out) {
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t k = 0; k < K; k += 16) {  // inputs k..k+15: the runs of even start k and odd start k + 1
    __m256i a = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(natural + k)), split);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(natural + k + 8)), split);
    __m256i packed = _mm256_permute4x64_epi64(  // int16 [8 evens, 8 odds]
        _mm256_packs_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + q4_position(k, K)), _mm256_castsi256_si128(packed));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + q4_position(k + 1, K)), _mm256_extracti128_si256(packed, 1));
  }
}

// Rows x [M, K] (K a multiple of 64) rounded as `int16_inverse` into the q4 layout (`q4_position`), `xs` [M] the
// rows' scales, `xsum` [M, G] the rounded rows' sums per group of K / G inputs for codes with a min (symmetric
// codes: zeros; the kernel takes their 8 off itself).
inline std::vector<int16_t> q4_activations_i16(const float* x, int64_t M, int64_t K, bool symmetric, int64_t G,
                                               std::vector<float>& xs, std::vector<float>& xsum) {
  std::vector<int16_t> q(M * K);
  std::vector<int32_t> natural(K);
  xs.resize(M);
  xsum.assign(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    const __m256 inverse = _mm256_set1_ps(int16_inverse(r, K, xs[m]));
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural.data() + k), round_i16x8(r + k, inverse));
    q4_layout_row(natural.data(), K, q.data() + m * K);
    for (int64_t g = 0, size = K / G; !symmetric && g < G; ++g) {
      int64_t total = 0;
      for (int64_t k = g * size; k < (g + 1) * size; ++k) total += natural[k];
      xsum[m * G + g] = float(total);
    }
  }
  return q;
}

// MG activation rows by NR weight rows (MG = 1 with NR = 2 or 4, or NR = 1): each chunk's activations are shared
// by the NR weight rows, and the per-row end (horizontal sums) is spread over NR rows' work. Chunks [c0, K / 64);
// `sums` (when given, [NR][MG]): sums of earlier chunks, in the same units.
template <int MG, int NR, bool kBlockScales, bool kSymmetric>
void q4_block(const int16_t* xq, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
              const float* offset, int64_t G, float* y, int64_t N, int64_t n, int64_t m0, int64_t c0 = 0,
              const float* sums = nullptr) {
  constexpr int kChains = NR == 1 ? 2 : 1;  // one weight row: two chains (even and odd chunks), half the FMA latency
  const __m256i low4 = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8), zero = _mm256_setzero_si256();
  __m256 acc[kChains][NR][MG];
  for (int h = 0; h < kChains; ++h)
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < MG; ++i) acc[h][r][i] = _mm256_setzero_ps();
  BlockGroups groups(K, G, 2 * c0);
  for (int64_t c = c0; c < K / 64; ++c) {
    const int64_t g0 = kBlockScales ? 2 * c : groups.next(), g1 = kBlockScales ? 2 * c + 1 : groups.next();
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + (n + r) * (K / 2) + 32 * c;
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kSymmetric) lo = _mm256_sub_epi8(lo, eight), hi = _mm256_sub_epi8(hi, eight);
      __m256i wv[4] = {_mm256_unpacklo_epi8(zero, lo), _mm256_unpackhi_epi8(zero, lo),
                       _mm256_unpacklo_epi8(zero, hi), _mm256_unpackhi_epi8(zero, hi)};
      const float* ws = scale + (n + r) * G;
      __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(ws + g0)), _mm_broadcast_ss(ws + g1), 1);
      for (int i = 0; i < MG; ++i) {
        const __m256i* xc = reinterpret_cast<const __m256i*>(xq + (m0 + i) * K + 64 * c);
        __m256i b = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(wv[0], _mm256_loadu_si256(xc)),
                             _mm256_madd_epi16(wv[1], _mm256_loadu_si256(xc + 1))),
            _mm256_add_epi32(_mm256_madd_epi16(wv[2], _mm256_loadu_si256(xc + 2)),
                             _mm256_madd_epi16(wv[3], _mm256_loadu_si256(xc + 3))));
        __m256& a = acc[kChains == 2 ? (c & 1) : 0][r][i];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), sv, a);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MG; ++i) {
      __m256 a = acc[0][r][i];
      if (kChains == 2) a = _mm256_add_ps(a, acc[kChains - 1][r][i]);
      float total = (hsum(a) + (sums ? sums[r * MG + i] : 0.f)) * (1.f / 256.f);
      if (!kSymmetric) total += min_correction(offset + (n + r) * G, xsum + (m0 + i) * G, G);
      y[(m0 + i) * N + n + r] = total;  // the row's activation scale: by the caller
    }
}


#endif  // !JAXINFER_AVX512_VNNI (the int16 layout)

// A register block of q4_nk in the layout of `xp`: byte-split (`I16Pair`) in 512-bit steps with AVX-512 VNNI, in
// 256-bit ones at avx2; avx2's int16 layout.
template <int MG, int NR, bool kBlockScales, bool kSymmetric>
inline void q4_step(const I16Pair* xp, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
                    const float* offset, int64_t G, float* y, int64_t N, int64_t n, int64_t m0) {
#ifdef JAXINFER_AVX512_VNNI
  q4_block512<MG, NR, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m0);
#else
  q4_block<MG, NR, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m0);
#endif
}
#ifndef JAXINFER_AVX512_VNNI
template <int MG, int NR, bool kBlockScales, bool kSymmetric>
inline void q4_step(const int16_t* xq, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
                    const float* offset, int64_t G, float* y, int64_t N, int64_t n, int64_t m0) {
  q4_block<MG, NR, kBlockScales, kSymmetric>(xq, xsum, K, w, scale, offset, G, y, N, n, m0);
}
#endif

// Which activation layout a call takes: byte-split at the 512-bit levels; at avx2 for one row of K <= 1024 inputs
// (SmolLM2's q/k/v, o and gate/up calls 1.07-1.12x faster than the int16 layout; at K = 1536 0.98x, at 8 rows
// 0.80-0.95x: `scripts/kernel_layers.py int4 --baseline`, session 29), else the int16 layout.
inline bool q4_byte_split([[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K) {
#ifdef JAXINFER_AVX512_VNNI
  return true;
#else
  return M == 1 && K <= 1024;
#endif
}

// Several activation rows, one weight row at a time, stream the rows' activations from L1 once per weight row;
// when they outgrow L1 (more than kQ4WideBytes), q4_rows_of takes kQ4WideNR weight rows at a time so that each
// activation load serves all of them. A SmolLM2 layer's calls at avx512_vnni (scripts/kernel_layers.py int4,
// against one weight row at a time): 1.26-1.29x faster at K = 576 with 32 rows (51 KiB of activations), 1.76x /
// 1.84x at K = 1536 with 16 / 32 rows; with 8 and 16 rows at K = 576 (13-26 KiB, in L1) the blocks took 0.95x.
constexpr int64_t kQ4WideBytes = 28 << 10;
#ifdef JAXINFER_AVX512_VNNI
constexpr int kQ4WideNR = 4;
inline int64_t q4_activation_bytes(int64_t M, int64_t K) { return M * ((K + 127) / 128) * int64_t(sizeof(I16Pair)); }
#else
constexpr int kQ4WideNR = 2;  // 16 vector registers
inline int64_t q4_activation_bytes(int64_t M, int64_t K) { return M * K * int64_t(sizeof(int16_t)); }
#endif

template <typename XA, bool kBlockScales, bool kSymmetric>
void q4_rows_of(const XA* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, const float* scale,
                const float* offset, int64_t G, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1 && K <= 1024)  // short rows: 4 at once (measured: 4 beat 2 by ~5% at K = 576, 2 beat 4 by ~20% at 1536)
    for (; n + 4 <= n1; n += 4) q4_step<1, 4, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, 0);
  if (M == 1)
    for (; n + 2 <= n1; n += 2) q4_step<1, 2, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, 0);
  if (M > 1 && q4_activation_bytes(M, K) > kQ4WideBytes)  // NR weight rows share each activation load
    for (; n + kQ4WideNR <= n1; n += kQ4WideNR) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        q4_step<2, kQ4WideNR, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m);
      if (m < M)
        q4_step<1, kQ4WideNR, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m);
    }
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      q4_step<2, 1, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m);
    if (m < M) q4_step<1, 1, kBlockScales, kSymmetric>(xp, xsum, K, w, scale, offset, G, y, N, n, m);
  }
}

template <typename XA>
void q4_rows(const XA* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, const float* scale,
             const float* offset, bool symmetric, int64_t G, float* y, int64_t N, int64_t n0, int64_t n1) {
  bool block_scales = K / G == 32;
  auto run = block_scales ? (symmetric ? q4_rows_of<XA, true, true> : q4_rows_of<XA, true, false>)
                          : (symmetric ? q4_rows_of<XA, false, true> : q4_rows_of<XA, false, false>);
  run(xp, xsum, M, K, w, scale, offset, G, y, N, n0, n1);
}

// A call's q4_nk activations in the layout `q4_byte_split` picks (`xs` [M], `xsum` [M, G] as q4_activations), and
// the rows [n0, n1) of a weight they multiply.
struct Q4Input {
  std::vector<I16Pair> pairs;  // byte-split
  std::vector<int16_t> words;  // avx2's int16 layout

  Q4Input() = default;
  Q4Input(const float* x, int64_t M, int64_t K, bool symmetric, int64_t G, std::vector<float>& xs,
          std::vector<float>& xsum) {
#ifndef JAXINFER_AVX512_VNNI
    if (!q4_byte_split(M, K)) {
      words = q4_activations_i16(x, M, K, symmetric, G, xs, xsum);
      return;
    }
#endif
    pairs = q4_activations(x, M, K, symmetric, G, xs, xsum);
  }
  void rows(const float* xsum, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* offset,
            bool symmetric, int64_t G, float* y, int64_t N, int64_t n0, int64_t n1) const {
#ifndef JAXINFER_AVX512_VNNI
    if (pairs.empty()) return q4_rows(words.data(), xsum, M, K, w, scale, offset, symmetric, G, y, N, n0, n1);
#endif
    q4_rows(pairs.data(), xsum, M, K, w, scale, offset, symmetric, G, y, N, n0, n1);
  }
};


// ---------------------------------------------------------------------------------------------------------------
// q4a8_nk: symmetric codes (w = s * (c - 8)), one scale a 32-input block, times activations quantized per block of
// 32 inputs to int8 (scale amax / 127, x / scale rounded to nearest even: `models.quant.quantize_rows`' numbers).
// vpmaddubsw multiplies the unsigned codes by the signed activations (a pair sum is at most 2 * 15 * 127, no
// saturation; with AVX-512 VNNI, vpdpbusd adds the products of four straight into int32 lanes that start at the
// offset); the -8 is taken off each block's int32 sum as 8 x the block's activation sum; each block's sum is
// scaled by (weight scale x activation scale) into the f32 totals. Per 64-input chunk (two blocks) the
// activations are laid out once a call (`A8Pair`, two chunks): the even inputs in one vector, the odd ones in
// another, each block in its own 128-bit lane, as the codes' nibbles fall (a 256-bit step reads one chunk's half
// of each field, a 512-bit step both).
struct A8Pair {
  int8_t even[64], odd[64];  // chunk h's inputs 2j and 2j + 1 at [32 h + j] (j < 16: block 0, j >= 16: block 1)
  int32_t offset[16];         // [8 h + 4 b + i]: -2 x the activation sum of chunk h's block b (4 lanes: -8 x)
  float scale[16];            // [8 h + 4 b + i]: the activation scale of chunk h's block b
};

// One 32-input block of `a8_pairs`: its inputs rounded to int8 (x / scale, nearest even), evens and odds stored
// at `at` of the pair's fields, -2 x their sum and the scale at `lane` .. `lane` + 3. All in vectors: a call
// quantizes every block of its rows before the threads start, so this is serial time (~0.7 us at K = 576 with
// a scalar de-interleave, ~0.1 us in vectors).
inline void a8_block(const float* r, A8Pair& pair, int lane, int at) {
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 v[4], amax8 = _mm256_setzero_ps(), finite8 = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(r + 8 * i);
    __m256 a = _mm256_andnot_ps(sign, v[i]);
    amax8 = _mm256_max_ps(amax8, a);
    finite8 = _mm256_and_ps(finite8, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for NaN and inf
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  if (_mm256_movemask_ps(finite8) != 0xff) {  // a row holding NaN or inf: NaN outputs (zero codes, NaN scale)
    std::fill(pair.even + at, pair.even + at + 16, int8_t(0));
    std::fill(pair.odd + at, pair.odd + at + 16, int8_t(0));
    for (int i = 0; i < 4; ++i)
      pair.offset[lane + i] = 0, pair.scale[lane + i] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float scale = amax > 0.f ? amax / 127.f : 1.f;
  const __m256 s8 = _mm256_set1_ps(scale), lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)  // x / scale as models.quant.quantize_rows divides (not x * (1 / scale))
    q[i] = _mm256_cvtps_epi32(_mm256_max_ps(nlim, _mm256_min_ps(lim, _mm256_div_ps(v[i], s8))));
  int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  store_even_odd(q, false, pair.even + at, pair.odd + at);
  for (int i = 0; i < 4; ++i) pair.offset[lane + i] = -2 * sum, pair.scale[lane + i] = scale;
}

// Rows x [M, K] (K a multiple of 64) as A8Pair [M, ceil(K / 128)] (an odd last chunk fills half a pair). A block
// holding NaN or inf gets a NaN scale, so the row's outputs are NaN (as its float products would not be finite).
inline std::vector<A8Pair> a8_pairs(const float* x, int64_t M, int64_t K) {
  const int64_t P = (K + 127) / 128;
  std::vector<A8Pair> out(M * P);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K / 64; ++c) {
      A8Pair& pair = out[m * P + c / 2];
      const int64_t h = c & 1;
      for (int b = 0; b < 2; ++b) a8_block(x + m * K + 64 * c + 32 * b, pair, 8 * h + 4 * b, 32 * h + 16 * b);
    }
  return out;
}

// MG activation rows by NR weight rows; the NR rows' codes and scales are read once for the MG rows. Chunks
// [c0, K / 64) in 256-bit steps; `sums` (when given, [MG][NR]): the earlier chunks' sums (q4a8_block512's).
template <int MG, int NR>
void q4a8_block(const A8Pair* xp, int64_t K, const uint8_t* w, const float* scale, float* y, int64_t N, int64_t n,
                int64_t m0, int64_t c0 = 0, const float* sums = nullptr) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = K / 32, C = K / 64, P = (K + 127) / 128;
  __m256 acc[MG][NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t c = c0; c < C; ++c) {
    __m256i lo[NR], hi[NR];
    __m256 ws[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + (n + r) * (K / 2) + 32 * c;
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      lo[r] = _mm256_and_si256(v, low4), hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const float* s = scale + (n + r) * G + 2 * c;
      ws[r] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(s)), _mm_broadcast_ss(s + 1), 1);
    }
    for (int i = 0; i < MG; ++i) {
      const A8Pair& x = xp[(m0 + i) * P + c / 2];
      const int64_t h = c & 1;
      __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.even + 32 * h));
      __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.odd + 32 * h));
      __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.offset + 8 * h));
      __m256 xs = _mm256_loadu_ps(x.scale + 8 * h);
      for (int r = 0; r < NR; ++r) {
#ifdef JAXINFER_AVX512_VNNI
        __m256i d = dot_u8i8(dot_u8i8(offset, lo[r], even), hi[r], odd);
#else
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], even), _mm256_maddubs_epi16(hi[r], odd));
        __m256i d = _mm256_add_epi32(_mm256_madd_epi16(p, ones), offset);
#endif
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws[r], xs), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * N + n + r] = hsum(acc[i][r]) + (sums ? sums[i * NR + r] : 0.f);
}

#ifdef JAXINFER_AVX512_VNNI
// The same in 512-bit steps: 128 inputs (a cache line of codes, four blocks, one a 128-bit lane) a step; an odd
// last chunk in a 256-bit step (q4a8_block from it).
template <int MG, int NR>
void q4a8_block512(const A8Pair* xp, int64_t K, const uint8_t* w, const float* scale, float* y, int64_t N, int64_t n,
                   int64_t m0) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t G = K / 32, P = (K + 127) / 128, S = K / 128;
  __m512 acc[MG][NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512i lo[NR], hi[NR];
    __m512 ws[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + (n + r) * (K / 2) + 64 * s;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m512i v = _mm512_loadu_si512(row);
      lo[r] = _mm512_and_si512(v, low4), hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      ws[r] = block_scales512(_mm_loadu_ps(scale + (n + r) * G + 4 * s));
    }
    for (int i = 0; i < MG; ++i) {
      const A8Pair& x = xp[(m0 + i) * P + s];
      __m512i even = _mm512_loadu_si512(x.even), odd = _mm512_loadu_si512(x.odd);
      __m512i offset = _mm512_loadu_si512(x.offset);
      __m512 xs = _mm512_loadu_ps(x.scale);
      for (int r = 0; r < NR; ++r) {
        __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(offset, lo[r], even), hi[r], odd);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], xs), acc[i][r]);
      }
    }
  }
  float sums[MG * NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) sums[i * NR + r] = _mm512_reduce_add_ps(acc[i][r]);
  q4a8_block<MG, NR>(xp, K, w, scale, y, N, n, m0, 2 * S, sums);  // an odd last chunk, and the row ends
}
#define JAXINFER_Q4A8_BLOCK q4a8_block512
#else
#define JAXINFER_Q4A8_BLOCK q4a8_block
#endif

// Weight rows [n0, n1) of y [M, N] (complete: no scale left to the caller).
inline void q4a8_rows(const A8Pair* xp, int64_t M, int64_t K, const uint8_t* w, const float* scale, float* y,
                      int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1) {  // as q4_rows_of: 4 rows share the activations at short K, 2 above
    if (K <= 1024)
      for (; n + 4 <= n1; n += 4) JAXINFER_Q4A8_BLOCK<1, 4>(xp, K, w, scale, y, N, n, 0);
    for (; n + 2 <= n1; n += 2) JAXINFER_Q4A8_BLOCK<1, 2>(xp, K, w, scale, y, N, n, 0);
  }
  for (; n + 2 <= n1; n += 2) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) JAXINFER_Q4A8_BLOCK<4, 2>(xp, K, w, scale, y, N, n, m);
    for (; m < M; ++m) JAXINFER_Q4A8_BLOCK<1, 2>(xp, K, w, scale, y, N, n, m);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) JAXINFER_Q4A8_BLOCK<1, 1>(xp, K, w, scale, y, N, n, m);
}
#undef JAXINFER_Q4A8_BLOCK

}  // namespace jaxinfer_gemv

#endif  // JAXINFER_CPU_GEMV_INT4_H_
