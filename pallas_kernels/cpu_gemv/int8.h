// The int8 kernels of gemv.cc (weights int8 [N, K], row-major): i8i8_nk (w8a8: int8 activations, exact int32
// sums) and int8_nk (weight-only: activations rounded to int16 per row, f32 scales per group of inputs).
#ifndef JAXINFER_CPU_GEMV_INT8_H_
#define JAXINFER_CPU_GEMV_INT8_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace jaxinfer_gemv {

// ---------------------------------------------------------------------------------------------------------------
// i8i8_nk: exact int8 x int8 -> int32 dot products, 32 inputs per step. vpmaddubsw multiplies unsigned by signed
// bytes, so |w| is the unsigned operand and x takes w's sign (the usual AVX2 trick); with both in [-127, 127] no
// pair sum saturates int16 (2 * 127 * 127 < 32767).
template <int MG, int NR>
void i8_block(const int8_t* x, int64_t K, const int8_t* w, int32_t* y, int64_t N, int64_t n, int64_t m0) {
  __m256i acc[MG][NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wv[NR], wa[NR];
    for (int r = 0; r < NR; ++r) {
      const int8_t* row = w + (n + r) * K + k;
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      wa[r] = _mm256_abs_epi8(wv[r]);
    }
    for (int i = 0; i < MG; ++i) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (m0 + i) * K + k));
      for (int r = 0; r < NR; ++r) {
        acc[i][r] = dot_u8i8(acc[i][r], wa[r], _mm256_sign_epi8(xv, wv[r]));
      }
    }
  }
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * N + n + r] = hsum_i32(acc[i][r]);
}

template <int NR>
void i8_rows_fixed(const int8_t* x, int64_t M, int64_t K, const int8_t* w, int32_t* y, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) i8_block<4, NR>(x, K, w, y, N, n, m);
  switch (M - m) {
    case 3: i8_block<3, NR>(x, K, w, y, N, n, m); break;
    case 2: i8_block<2, NR>(x, K, w, y, N, n, m); break;
    case 1: i8_block<1, NR>(x, K, w, y, N, n, m); break;
    default: break;
  }
}

// One activation row, one weight row at a time (longer rows; a single stream reads cold weights fastest, measured),
// two int32 chains over K.
void i8_row(const int8_t* x, int64_t K, const int8_t* w, int32_t* y, int64_t n) {
  const int8_t* row = w + n * K;
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t k = 0; k < K; k += 32) {
    if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
    __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
    acc[(k >> 5) & 1] = dot_u8i8(acc[(k >> 5) & 1], _mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
  }
  y[n] = hsum_i32(_mm256_add_epi32(acc[0], acc[1]));
}

#ifdef JAXINFER_AVX512_VNNI
// i8i8_nk in 512-bit steps (64 inputs a step), one weight row by MG activation rows. vpdpbusd multiplies unsigned
// by signed bytes, so the activations arrive as xu = x + 128 (`i8_unsigned`, once a call): the row's sum of
// (x + 128) * w, less 128 x its sum of w (vpdpbusd of ones by w, beside), is x . w, exact for any int8 values.
template <int MG>
void i8_row512(const uint8_t* xu, int64_t K, const int8_t* w, int32_t* y, int64_t N, int64_t n, int64_t m0) {
  const int8_t* row = w + n * K;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MG], wsum = _mm512_setzero_si512();
  for (int i = 0; i < MG; ++i) acc[i] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
    __m512i wv = _mm512_loadu_si512(row + k);
    wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    for (int i = 0; i < MG; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512(xu + (m0 + i) * K + k), wv);
  }
  int32_t total = _mm512_reduce_add_epi32(wsum), tail[MG] = {};
  if (k < K) {  // the last 32 inputs (K is a multiple of 32)
    __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    total += hsum_i32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), wv));
    for (int i = 0; i < MG; ++i)
      tail[i] = hsum_i32(_mm256_dpbusd_epi32(
          _mm256_setzero_si256(), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + (m0 + i) * K + k)), wv));
  }
  for (int i = 0; i < MG; ++i)  // wrapping int32 arithmetic: exact wherever the true sum fits in int32
    y[(m0 + i) * N + n] = int32_t(uint32_t(_mm512_reduce_add_epi32(acc[i])) + uint32_t(tail[i]) - 128u * uint32_t(total));
}
#endif

// The activations of i8_rows' 512-bit steps, x + 128 as unsigned bytes (empty on the AVX2 level, which reads x).
inline std::vector<uint8_t> i8_unsigned(const int8_t* x, int64_t size) {
  std::vector<uint8_t> xu;
#ifdef JAXINFER_AVX512_VNNI
  xu.resize(size);
  for (int64_t i = 0; i < size; ++i) xu[i] = uint8_t(x[i]) ^ 0x80;
#endif
  return xu;
}

// Weight rows [n0, n1) of y [M, N]; `xu`: i8_unsigned(x).
void i8_rows(const int8_t* x, [[maybe_unused]] const uint8_t* xu, int64_t M, int64_t K, const int8_t* w, int32_t* y,
             int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef JAXINFER_AVX512_VNNI
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) i8_row512<4>(xu, K, w, y, N, n, m);
    for (; m + 2 <= M; m += 2) i8_row512<2>(xu, K, w, y, N, n, m);
    if (m < M) i8_row512<1>(xu, K, w, y, N, n, m);
  }
  return;
#endif
  if (M == 1) {  // four weight rows a block where K <= 1024: SmolLM2's q/k/v and o 1.06x, gate/up 1.03x (session 29)
    if (K <= 1024)
      for (; n + 4 <= n1; n += 4) i8_block<1, 4>(x, K, w, y, N, n, 0);
    for (; n < n1; ++n) i8_row(x, K, w, y, n);
    return;
  }
  for (; n + 2 <= n1; n += 2) i8_rows_fixed<2>(x, M, K, w, y, N, n);
  for (; n < n1; ++n) i8_rows_fixed<1>(x, M, K, w, y, N, n);
}

// ---------------------------------------------------------------------------------------------------------------
// int8_nk: int8 weights times activations quantized per row to int16 (absmax / 32767: a relative error of at most
// 1 / 65534 of the row's largest input, finer than bf16's 8 bits). vpmaddwd multiplies 16 pairs and adds adjacent
// products into int32 lanes; a lane takes at most 128 steps (2048 inputs: 128 * 2 * 32767 * 127 < 2^31) before its
// sum is converted and scaled into the f32 totals, at every group end too.
template <int MG, int NR>
void i16_block(const int16_t* x, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y, int64_t N,
               int64_t n, int64_t m0) {
  const int64_t group = K / G;
  __m256 total[MG][NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) total[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 2048) {
      __m256i acc[MG][NR];
      for (int i = 0; i < MG; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_si256();
      for (int64_t k = k0, k1 = std::min(k0 + 2048, (g + 1) * group); k < k1; k += 16) {
        __m256i wv[NR];
        for (int r = 0; r < NR; ++r) {
          const int8_t* row = w + (n + r) * K + k;
          if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
          wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
        }
        for (int i = 0; i < MG; ++i) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (m0 + i) * K + k));
          for (int r = 0; r < NR; ++r) acc[i][r] = dot_i16(acc[i][r], xv, wv[r]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        __m256 s = _mm256_set1_ps(scale[(n + r) * G + g]);
        for (int i = 0; i < MG; ++i) total[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), s, total[i][r]);
      }
    }
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * N + n + r] = hsum(total[i][r]);
}

// Groups of 32 inputs (GGUF Q8_0's blocks): one int32 sum a block and row, scaled straight into the f32 totals, with
// no inner loop a block (i16_block's per-group loop costs more than a 32-input group's arithmetic).
template <int MG>
void i16_g32_row(const int16_t* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N, int64_t n,
                 int64_t m0) {
  const int64_t G = K / 32;
  const int8_t* row = w + n * K;
  const float* ws = scale + n * G;
  __m256 total[2][MG];  // two chains (even and odd blocks) for the FMA latency
  for (int i = 0; i < MG; ++i) total[0][i] = total[1][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 32 * g) + kPrefetchBytes, _MM_HINT_T0);
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g + 16)));
    __m256 s = _mm256_broadcast_ss(ws + g);
    for (int i = 0; i < MG; ++i) {
      const __m256i* xc = reinterpret_cast<const __m256i*>(x + (m0 + i) * K + 32 * g);
      __m256i b = dot_i16(_mm256_madd_epi16(w0, _mm256_loadu_si256(xc)), w1, _mm256_loadu_si256(xc + 1));
      total[g & 1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), s, total[g & 1][i]);
    }
  }
  for (int i = 0; i < MG; ++i) y[(m0 + i) * N + n] = hsum(_mm256_add_ps(total[0][i], total[1][i]));
}

// i16_g32_row for one activation row and NR weight rows: each block's activation loads serve the NR rows (a chain
// a row), as i16_block<1, 4> does for wider groups.
template <int NR>
void i16_g32_nr(const int16_t* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t n) {
  const int64_t G = K / 32;
  __m256 total[NR];
  for (int r = 0; r < NR; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256i* xc = reinterpret_cast<const __m256i*>(x + 32 * g);
    const __m256i x0 = _mm256_loadu_si256(xc), x1 = _mm256_loadu_si256(xc + 1);
    for (int r = 0; r < NR; ++r) {
      const int8_t* row = w + (n + r) * K + 32 * g;
      if ((g & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
      __m256i b = dot_i16(_mm256_madd_epi16(w0, x0), w1, x1);
      total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_broadcast_ss(scale + (n + r) * G + g), total[r]);
    }
  }
  for (int r = 0; r < NR; ++r) y[n + r] = hsum(total[r]);
}

template <int NR>
void i16_rows_fixed(const int16_t* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
                    int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) i16_block<2, NR>(x, K, w, scale, G, y, N, n, m);
  if (m < M) i16_block<1, NR>(x, K, w, scale, G, y, N, n, m);
}

#ifdef JAXINFER_AVX512_VNNI
// int8_nk in 512-bit steps for groups of a multiple of 32 inputs: 32 inputs a step (vpmovsxbw, vpdpwssd), one
// weight row by MG activation rows. kG32: groups of exactly 32 (one step a group, its sum scaled straight into
// the totals, two chains); else each group's int32 sums (two chains, at most 2048 inputs: no lane overflows, as
// i16_block) are scaled at its end.
template <int MG, bool kG32>
void i16_row512(const int16_t* x, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y, int64_t N,
                int64_t n, int64_t m0) {
  const int64_t group = K / G;
  const int8_t* row = w + n * K;
  const float* ws = scale + n * G;
  __m512 total[2][MG];
  for (int i = 0; i < MG; ++i) total[0][i] = total[1][i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __m512i* acc) {  // acc[i] += x[m0 + i, k:k+32] . row[k:k+32] (pairwise)
    if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
    __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
    for (int i = 0; i < MG; ++i)
      acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_loadu_si512(x + (m0 + i) * K + k), wv);
  };
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(ws[g]);
    if (kG32) {
      __m512i acc[MG];
      for (int i = 0; i < MG; ++i) acc[i] = _mm512_setzero_si512();
      step(32 * g, acc);
      for (int i = 0; i < MG; ++i) total[g & 1][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), s, total[g & 1][i]);
      continue;
    }
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 2048) {
      __m512i acc[2][MG];
      for (int i = 0; i < MG; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_si512();
      int64_t k = k0, k1 = std::min(k0 + 2048, (g + 1) * group);
      for (; k + 64 <= k1; k += 64) step(k, acc[0]), step(k + 32, acc[1]);
      if (k < k1) step(k, acc[0]);
      for (int i = 0; i < MG; ++i)
        total[0][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][i], acc[1][i])), s, total[0][i]);
    }
  }
  for (int i = 0; i < MG; ++i) y[(m0 + i) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(total[0][i], total[1][i]));
}

// One activation row by NR weight rows: each activation load serves the NR rows (groups of a multiple of 32).
template <int NR>
void i16_nr512(const int16_t* x, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y, int64_t n) {
  const int64_t group = K / G;
  __m512 total[NR];
  for (int r = 0; r < NR; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 2048) {  // at most 2048 inputs a sum, as i16_block
      __m512i acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
      for (int64_t k = k0, k1 = std::min(k0 + 2048, (g + 1) * group); k < k1; k += 32) {
        const __m512i xv = _mm512_loadu_si512(x + k);
        for (int r = 0; r < NR; ++r) {
          const int8_t* row = w + (n + r) * K + k;
          if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
          acc[r] = _mm512_dpwssd_epi32(acc[r], xv,
                                       _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))));
        }
      }
      for (int r = 0; r < NR; ++r)
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(scale[(n + r) * G + g]), total[r]);
    }
  for (int r = 0; r < NR; ++r) y[n + r] = _mm512_reduce_add_ps(total[r]);
}

template <bool kG32>
void i16_rows512(const int16_t* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
                 int64_t N, int64_t n0, int64_t n1) {
  if (M == 1)  // four weight rows a block: SmolLM2's calls and LM head 1.08-1.46x in L3, a 256 MiB weight 1.09x
    for (; n0 + 4 <= n1; n0 += 4) i16_nr512<4>(x, K, w, scale, G, y, n0);
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) i16_row512<4, kG32>(x, K, w, scale, G, y, N, n, m);
    for (; m + 2 <= M; m += 2) i16_row512<2, kG32>(x, K, w, scale, G, y, N, n, m);
    if (m < M) i16_row512<1, kG32>(x, K, w, scale, G, y, N, n, m);
  }
}
#endif

void i16_rows(const int16_t* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
              int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef JAXINFER_AVX512_VNNI
  if ((K / G) % 32 == 0) {
    if (K / G == 32) i16_rows512<true>(x, M, K, w, scale, G, y, N, n0, n1);
    else i16_rows512<false>(x, M, K, w, scale, G, y, N, n0, n1);
    return;
  }
#endif
  if (K / G == 32) {  // GGUF Q8_0
    // One activation row, short rows: four weight rows a block (session 29, SmolLM2's shapes stacked, from DRAM /
    // in L3: K = 576 1.03-1.05x / 1.08-1.40x, the LM head the most; K = 1536 0.86x / 0.87x: one row at a time)
    if (M == 1 && K <= 1024)
      for (; n + 4 <= n1; n += 4) i16_g32_nr<4>(x, K, w, scale, y, n);
    for (; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) i16_g32_row<2>(x, K, w, scale, y, N, n, m);
      if (m < M) i16_g32_row<1>(x, K, w, scale, y, N, n, m);
    }
    return;
  }
  if (M == 1) {  // four weight rows share each activation load: SmolLM2's layer calls and LM head 1.38-1.46x faster
    // than one row at a time with the weights in L3 (session 28), the same from DRAM (a 256 MiB weight: 1.02x)
    for (; n + 4 <= n1; n += 4) i16_block<1, 4>(x, K, w, scale, G, y, N, n, 0);
    for (; n < n1; ++n) i16_block<1, 1>(x, K, w, scale, G, y, N, n, 0);
    return;
  }
  for (; n + 2 <= n1; n += 2) i16_rows_fixed<2>(x, M, K, w, scale, G, y, N, n);
  for (; n < n1; ++n) i16_rows_fixed<1>(x, M, K, w, scale, G, y, N, n);
}

}  // namespace jaxinfer_gemv

#endif  // JAXINFER_CPU_GEMV_INT8_H_
