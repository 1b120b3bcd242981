// The bf16 / f32 kernels of gemv.cc: float_kn (input-major weights [K, N], the model's plain layout) and float_nk
// (row-major [N, K], a tied embedding used as the LM head), x f32 [M, K], y f32.
#ifndef JAXINFER_CPU_GEMV_FLOAT_H_
#define JAXINFER_CPU_GEMV_FLOAT_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace jaxinfer_gemv {

// float_kn: y = x @ w for w [K, N] (K a multiple of 4). The work is split along K: each chunk reads a contiguous
// block of whole weight rows (one sequential stream, no page-hopping) into a partial sum of all N outputs, kept in
// L1 / L2, and the partial sums are added in chunk order (the result does not depend on the threads). Within a
// chunk, four weight rows at a time are added into the partial sums, MG activation rows sharing each converted
// weight vector.
template <typename T, int MG>
void kn_quad(const float* x, int64_t K, const T* w, int64_t N, float* y, int64_t k, int64_t m0) {
  __m256 b[MG][4];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < 4; ++r) b[i][r] = _mm256_broadcast_ss(x + (m0 + i) * K + k + r);
  const T* w0 = w + k * N;
  int64_t n = 0;
  constexpr int64_t kLine = 64 / sizeof(T);  // weights per cache line
  for (; n + 8 <= N; n += 8) {
    if (n % kLine == 0)  // the next four rows' line at this column: one quad (4 N weights) ahead
      for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(w0 + (4 + r) * N + n), _MM_HINT_T0);
    __m256 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load8(w0 + r * N + n);
    for (int i = 0; i < MG; ++i) {
      float* yp = y + (m0 + i) * N + n;
      __m256 a = _mm256_loadu_ps(yp);
      for (int r = 0; r < 4; ++r) a = _mm256_fmadd_ps(b[i][r], wv[r], a);
      _mm256_storeu_ps(yp, a);
    }
  }
  for (; n < N; ++n)
    for (int i = 0; i < MG; ++i)
      for (int r = 0; r < 4; ++r) y[(m0 + i) * N + n] += x[(m0 + i) * K + k + r] * to_f32(w0[r * N + n]);
}

// Rows [k0, k1) of w into the partial sums y [M, N] (zeroed here).
template <typename T>
void float_kn_rows(const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y, int64_t k0, int64_t k1) {
  std::fill(y, y + M * N, 0.f);
  for (int64_t k = k0; k < k1; k += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) kn_quad<T, 2>(x, K, w, N, y, k, m);
    if (m < M) kn_quad<T, 1>(x, K, w, N, y, k, m);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// float_nk: row-major weights [N, K] (K a multiple of 8), NR weight rows by MG activation rows per register block.
template <typename T, int MG, int NR>
void nk_block(const float* x, int64_t K, const T* w, float* y, int64_t N, int64_t n, int64_t m0) {
  __m256 acc[MG][NR];
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) {
      const T* row = w + (n + r) * K + k;
      if ((k & (64 / sizeof(T) - 1)) == 0)  // once per cache line
        _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = load8(row);
    }
    for (int i = 0; i < MG; ++i) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MG; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * N + n + r] = hsum(acc[i][r]);
}

template <typename T, int NR>
void nk_rows_fixed(const float* x, int64_t M, int64_t K, const T* w, float* y, int64_t N,
                   int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) nk_block<T, 4, NR>(x, K, w, y, N, n, m);
  switch (M - m) {
    case 3: nk_block<T, 3, NR>(x, K, w, y, N, n, m); break;
    case 2: nk_block<T, 2, NR>(x, K, w, y, N, n, m); break;
    case 1: nk_block<T, 1, NR>(x, K, w, y, N, n, m); break;
    default: break;
  }
}

// One activation row, one weight row at a time (a single stream reads cold weights fastest, measured), four FMA
// chains over K.
template <typename T>
void nk_row(const float* x, int64_t K, const T* w, float* y, int64_t n) {
  const T* row = w + n * K;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int64_t b = 0; b < 32 * int64_t(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + b + kPrefetchBytes, _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * j), load8(row + k + 8 * j), acc[j]);
  }
  for (; k < K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(row + k), acc[0]);
  y[n] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <typename T>
void nk_rows(const float* x, int64_t M, int64_t K, const T* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1) {
    for (; n < n1; ++n) nk_row(x, K, w, y, n);
    return;
  }
  for (; n + 2 <= n1; n += 2) nk_rows_fixed<T, 2>(x, M, K, w, y, N, n);
  for (; n < n1; ++n) nk_rows_fixed<T, 1>(x, M, K, w, y, N, n);
}


}  // namespace jaxinfer_gemv

#endif  // JAXINFER_CPU_GEMV_FLOAT_H_
