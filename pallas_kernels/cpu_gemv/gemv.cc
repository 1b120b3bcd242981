// Matrix times a few activation rows (decode's GEMV, M <= 8) on x86 CPUs, called from jitted JAX code through
// XLA's FFI (jax.ffi.ffi_call). Built by pallas_kernels/cpu_gemv/build.py, once per ISA level, with the compiler
// on the machine; the Python wrappers in pallas_kernels/cpu_gemv/__init__.py give the shapes and dtypes.
//
// Decode reads every weight once per step for one to a few activation rows, so these kernels are built to stream
// the weight from memory at full speed: one pass over it, a few rows of outputs kept in registers, software
// prefetch ahead of the stream, work split over persistent worker threads (no fork or wake-up per call).
//
// Kernels (x: f32 [M, K] row-major; y: [M, N]):
//   float_kn   w bf16|f32 [K, N] (the model's plain layout, input-major)        y f32 = x @ w
//   float_nk   w bf16|f32 [N, K] (a tied embedding used as the LM head)        y f32 = x @ w.T
//   int8_nk    w int8 [N, K], scale f32 [N, G] per K/G inputs (weight-only), x rounded to int16 per row here
//   i8i8_nk    xq int8 [M, K], w int8 [N, K] (w8a8: values in [-127, 127])      y i32 = xq @ w.T (exact)
//   q4_nk      w uint8 [N, K/2] (two 4-bit codes per byte, element 2j low nibble), scale f32 [N, G], x rounded
//              here to int16 per row (as int8_nk) and multiplied exactly with the codes:
//              y f32 = xs * (sum_blocks ws * (codes . xq) + corr), where corr (the -8 offset or the per-group min
//              times the rounded activations' group sums) is added per group from `offset` [N, G] and `xsum` [M, G].
#include <immintrin.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"
#include "threads.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_gemv::at_layer;
using jaxinfer_gemv::hsum;
using jaxinfer_gemv::hsum_i32;
using jaxinfer_gemv::load8;
using jaxinfer_gemv::max_threads;
using jaxinfer_gemv::parallel_chunks;
using jaxinfer_gemv::rows_per_chunk;
using jaxinfer_gemv::to_f32;

#if !defined(__AVX2__) || !defined(__FMA__)
#error "gemv.cc needs AVX2 and FMA (build.py passes -mavx2 -mfma)"
#endif

constexpr int kPrefetchBytes = 512;  // how far ahead of each weight stream to prefetch

// ---------------------------------------------------------------------------------------------------------------
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

template <typename T>
void nk_rows(const float* x, int64_t M, int64_t K, const T* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) nk_block<T, 1, 4>(x, K, w, y, N, n, 0);
  }
  for (; n + 2 <= n1; n += 2) nk_rows_fixed<T, 2>(x, M, K, w, y, N, n);
  for (; n < n1; ++n) nk_rows_fixed<T, 1>(x, M, K, w, y, N, n);
}

// ---------------------------------------------------------------------------------------------------------------
// i8i8_nk: exact int8 x int8 -> int32 dot products, 32 inputs per step. vpmaddubsw multiplies unsigned by signed
// bytes, so |w| is the unsigned operand and x takes w's sign (the usual AVX2 trick); with both in [-127, 127] no
// pair sum saturates int16 (2 * 127 * 127 < 32767).
template <int MG, int NR>
void i8_block(const int8_t* x, int64_t K, const int8_t* w, int32_t* y, int64_t N, int64_t n, int64_t m0) {
  const __m256i ones = _mm256_set1_epi16(1);
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
        __m256i p = _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(xv, wv[r]));
        acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(p, ones));
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

void i8_rows(const int8_t* x, int64_t M, int64_t K, const int8_t* w, int32_t* y, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) i8_block<1, 4>(x, K, w, y, N, n, 0);
  }
  for (; n + 2 <= n1; n += 2) i8_rows_fixed<2>(x, M, K, w, y, N, n);
  for (; n < n1; ++n) i8_rows_fixed<1>(x, M, K, w, y, N, n);
}

// ---------------------------------------------------------------------------------------------------------------
// q4_nk: 64 inputs (32 bytes of codes) per step. Low nibbles are the even inputs and high nibbles the odd ones, so
// the caller lays out each 64-input chunk of the int16 activations as its 32 even inputs then its 32 odd ones. The
// codes widen to int16 and vpmaddwd multiplies them exactly with the activations; each 32-input block's int32 sums
// are scaled by the block's weight scale into f32 totals (in units of the row's activation scale, applied last).
template <int MG>
void q4_row(const int16_t* xq, const float* xsum, int64_t K, const uint8_t* w, const float* scale,
            const float* offset, float offset_factor, int64_t G, float* y, int64_t N, int64_t n, int64_t m0) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const int64_t blocks_per_group = K / G / 32;
  const uint8_t* row = w + n * (K / 2);
  const float* ws = scale + n * G;
  __m256 acc[MG];
  for (int i = 0; i < MG; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 64; ++c) {
    if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 32 * c) + kPrefetchBytes, _MM_HINT_T0);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    __m256i e0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), e1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
    __m256i o0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), o1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
    __m256 s0 = _mm256_broadcast_ss(ws + (2 * c) / blocks_per_group);
    __m256 s1 = _mm256_broadcast_ss(ws + (2 * c + 1) / blocks_per_group);
    for (int i = 0; i < MG; ++i) {
      const __m256i* xc = reinterpret_cast<const __m256i*>(xq + (m0 + i) * K + 64 * c);
      __m256i b0 = _mm256_add_epi32(_mm256_madd_epi16(e0, _mm256_loadu_si256(xc)),
                                    _mm256_madd_epi16(o0, _mm256_loadu_si256(xc + 2)));
      __m256i b1 = _mm256_add_epi32(_mm256_madd_epi16(e1, _mm256_loadu_si256(xc + 1)),
                                    _mm256_madd_epi16(o1, _mm256_loadu_si256(xc + 3)));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b0), s0, acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b1), s1, acc[i]);
    }
  }
  const float* off = offset + n * G;
  for (int i = 0; i < MG; ++i) {
    const float* xg = xsum + (m0 + i) * G;
    __m256 c8 = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) c8 = _mm256_fmadd_ps(_mm256_loadu_ps(off + g), _mm256_loadu_ps(xg + g), c8);
    float corr = hsum(c8);
    for (; g < G; ++g) corr += off[g] * xg[g];
    y[(m0 + i) * N + n] = hsum(acc[i]) + offset_factor * corr;  // the row's activation scale: by the caller
  }
}

void q4_rows(const int16_t* xq, const float* xsum, int64_t M, int64_t K, const uint8_t* w, const float* scale,
             const float* offset, float offset_factor, int64_t G, float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) q4_row<2>(xq, xsum, K, w, scale, offset, offset_factor, G, y, N, n, m);
    if (m < M) q4_row<1>(xq, xsum, K, w, scale, offset, offset_factor, G, y, N, n, m);
  }
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
          for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(xv, wv[r]));
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

template <int NR>
void i16_rows_fixed(const int16_t* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
                    int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) i16_block<2, NR>(x, K, w, scale, G, y, N, n, m);
  if (m < M) i16_block<1, NR>(x, K, w, scale, G, y, N, n, m);
}

void i16_rows(const int16_t* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t G, float* y,
              int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1)
    for (; n + 4 <= n1; n += 4) i16_block<1, 4>(x, K, w, scale, G, y, N, n, 0);
  for (; n + 2 <= n1; n += 2) i16_rows_fixed<2>(x, M, K, w, scale, G, y, N, n);
  for (; n < n1; ++n) i16_rows_fixed<1>(x, M, K, w, scale, G, y, N, n);
}

// ---------------------------------------------------------------------------------------------------------------
// FFI handlers. Shapes are checked in Python (pallas_kernels/cpu_gemv/__init__.py); the handlers check ranks.
// Weights arrive stacked, [L, ...] (L = 1 for a single layer's array), with the layer to read as an int32 scalar
// operand: a scanned model passes the whole stack and its loop index, so no slice of the stack is ever copied.
ffi::Error rank3(const ffi::AnyBuffer& b, const char* name) {
  if (b.dimensions().size() != 3) return ffi::Error::InvalidArgument(std::string(name) + " must be [L, rows, cols]");
  return ffi::Error::Success();
}

template <typename T>
void float_call(const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y, bool kn) {
  if (kn) {
    int64_t threads = max_threads();
    int64_t rows = std::max<int64_t>(64, (K / (2 * threads) + 3) / 4 * 4);
    int64_t count = (K + rows - 1) / rows;
    std::vector<float> partial(count * M * N);
    parallel_chunks(count, [&](int64_t c) {
      float_kn_rows(x, M, K, w, N, partial.data() + c * M * N, c * rows, std::min(K, (c + 1) * rows));
    });
    std::copy(partial.begin(), partial.begin() + M * N, y);
    for (int64_t c = 1; c < count; ++c)
      for (int64_t i = 0; i < M * N; ++i) y[i] += partial[c * M * N + i];
    return;
  }
  int64_t rows = rows_per_chunk(N, 8, 16);
  parallel_chunks((N + rows - 1) / rows, [&](int64_t c) {
    int64_t n0 = c * rows, n1 = std::min(N, n0 + rows);
    nk_rows(x, M, K, w, y, N, n0, n1);
  });
}

// Activations as f32 [M, K]: f32 ones in place, bf16 ones converted into `tmp`.
const float* activations_f32(const ffi::AnyBuffer& x, std::vector<float>& tmp) {
  if (x.element_type() == ffi::F32) return reinterpret_cast<const float*>(x.untyped_data());
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
  tmp.resize(x.element_count());
  for (size_t i = 0; i < tmp.size(); ++i) tmp[i] = to_f32(p[i]);
  return tmp.data();
}

ffi::Error check_activations(const ffi::AnyBuffer& x) {
  if (x.dimensions().size() != 2 || (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16))
    return ffi::Error::InvalidArgument("activations must be f32 or bf16 [M, K]");
  return ffi::Error::Success();
}

ffi::Error FloatMatmul(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w,
                       ffi::ResultBuffer<ffi::F32> y, bool kn) {
  if (auto e = rank3(w, "w"); e.failure()) return e;
  if (auto e = check_activations(x); e.failure()) return e;
  std::vector<float> tmp;
  const float* xf = activations_f32(x, tmp);
  int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  int64_t N = kn ? w.dimensions()[2] : w.dimensions()[1];
  if (w.element_type() == ffi::BF16)
    float_call(xf, M, K, at_layer<uint16_t>(w, layer), N, y->typed_data(), kn);
  else if (w.element_type() == ffi::F32)
    float_call(xf, M, K, at_layer<float>(w, layer), N, y->typed_data(), kn);
  else
    return ffi::Error::InvalidArgument("float_matmul: w must be bf16 or f32");
  return ffi::Error::Success();
}

// Activation rows rounded to int16 (absmax / 32767, nearest even), with each row's scale: the weight-only kernels'
// activations (int8_nk, q4_nk). `chunked`: each 64-input chunk laid out as its even inputs then its odd ones
// (q4_nk's nibble order); `xsum` (when given, [M, G]): the rounded rows' sums per group of K / G inputs.
std::vector<int16_t> int16_rows(const float* x, int64_t M, int64_t K, bool chunked, std::vector<float>& xs,
                                std::vector<float>* xsum = nullptr, int64_t G = 1) {
  std::vector<int16_t> q(M * K);
  xs.resize(M);
  if (xsum) xsum->assign(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(x[m * K + k]);
      amax = std::max(amax, std::fabs(x[m * K + k]));
    }
    // a row holding NaN or inf gives NaN outputs (its products would not be finite either)
    float inverse = finite && amax > 0.f ? 32767.f / amax : 0.f;
    xs[m] = finite ? amax / 32767.f : std::numeric_limits<float>::quiet_NaN();
    for (int64_t k = 0; k < K; ++k) {
      int16_t v = int16_t(std::max(-32767.f, std::min(32767.f, std::nearbyint(x[m * K + k] * inverse))));
      int64_t at = chunked ? (k / 64) * 64 + (k % 2) * 32 + (k % 64) / 2 : k;
      q[m * K + at] = v;
      if (xsum) (*xsum)[m * G + k / (K / G)] += float(v);
    }
  }
  return q;
}

ffi::Error Int8Matmul(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = check_activations(x); e.failure()) return e;
  if (auto e = rank3(w, "w"); e.failure()) return e;
  if (auto e = rank3(scale, "scale"); e.failure()) return e;
  std::vector<float> tmp;
  const float* xf = activations_f32(x, tmp);
  int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1], G = scale.dimensions()[2];
  std::vector<float> xs;
  std::vector<int16_t> xq = int16_rows(xf, M, K, false, xs);
  const int8_t* wl = at_layer<int8_t>(w, layer);
  const float* sl = at_layer<float>(scale, layer);
  float* out = y->typed_data();
  int64_t rows = rows_per_chunk(N, 8, 16);
  parallel_chunks((N + rows - 1) / rows, [&](int64_t c) {
    int64_t n0 = c * rows;
    i16_rows(xq.data(), M, K, wl, sl, G, out, N, n0, std::min(N, n0 + rows));
  });
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) out[m * N + n] *= xs[m];
  return ffi::Error::Success();
}

ffi::Error I8I8Matmul(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::S32> y) {
  if (auto e = rank3(w, "w"); e.failure()) return e;
  int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  const int8_t* wl = at_layer<int8_t>(w, layer);
  int64_t rows = rows_per_chunk(N, 8, 16);
  parallel_chunks((N + rows - 1) / rows, [&](int64_t c) {
    int64_t n0 = c * rows;
    i8_rows(x.typed_data(), M, K, wl, y->typed_data(), N, n0, std::min(N, n0 + rows));
  });
  return ffi::Error::Success();
}

ffi::Error Q4Matmul(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                    ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y, float offset_factor) {
  if (auto e = check_activations(x); e.failure()) return e;
  for (auto* b : {&w, &scale, &offset})
    if (auto e = rank3(*b, "w, scale and offset"); e.failure()) return e;
  std::vector<float> tmp, xs, xsum;
  const float* xf = activations_f32(x, tmp);
  int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1], G = scale.dimensions()[2];
  std::vector<int16_t> xq = int16_rows(xf, M, K, true, xs, &xsum, G);
  const uint8_t* wl = at_layer<uint8_t>(w, layer);
  const float *sl = at_layer<float>(scale, layer), *ol = at_layer<float>(offset, layer);
  float* out = y->typed_data();
  int64_t rows = rows_per_chunk(N, 8, 16);
  parallel_chunks((N + rows - 1) / rows, [&](int64_t c) {
    int64_t n0 = c * rows;
    q4_rows(xq.data(), xsum.data(), M, K, wl, sl, ol, offset_factor, G, out, N, n0, std::min(N, n0 + rows));
  });
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) out[m * N + n] *= xs[m];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_float_matmul, FloatMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("kn"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_i8i8_matmul, I8I8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_q4_matmul, Q4Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("offset_factor"));
