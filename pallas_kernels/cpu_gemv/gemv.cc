// Matrix times a few activation rows (decode's GEMV, M <= 32) on x86 CPUs, called from jitted JAX code through
// XLA's FFI (jax.ffi.ffi_call). Built by pallas_kernels/cpu_gemv/build.py, once per ISA level, with the compiler
// on the machine; the Python wrappers in pallas_kernels/cpu_gemv/__init__.py give the shapes and dtypes.
//
// Decode reads every weight once per step for one to a few activation rows, so these kernels are built to stream
// the weight from memory at full speed: one pass over it, a few rows of outputs kept in registers, software
// prefetch ahead of the stream, work split over persistent worker threads (no fork or wake-up per call).
//
// Kernels (x: f32 [M, K] row-major; y: [M, N]):
//   float_kn   (float.h) w bf16|f32 [K, N] (the model's plain layout, input-major)        y f32 = x @ w
//   float_nk   (float.h) w bf16|f32 [N, K] (a tied embedding used as the LM head)        y f32 = x @ w.T
//   int8_nk    (int8.h) w int8 [N, K], scale f32 [N, G] per K/G inputs (weight-only), x rounded to int16 per row here
//   i8i8_nk    (int8.h) xq int8 [M, K], w int8 [N, K] (w8a8: values in [-127, 127])  y i32 = xq @ w.T (exact)
//   q4_nk      (int4.h) w uint8 [N, K/2] (two 4-bit codes per byte, element 2j low nibble), scale f32 [N, G], x
//              rounded here to int16 per row (as int8_nk) and multiplied exactly with the codes:
//              y f32 = xs * (sum_blocks ws * ((codes - 8) . xq) + corr) for symmetric codes (the 8 taken off inside
//              the integer sums), or with the codes and corr = the per-group min (`offset` [N, G]) times the
//              rounded activations' group sums (`xsum` [M, G]); at avx512_vnni xq is split into its high and low
//              bytes (`I16Pair`; at avx2 for one row of K <= 1024, else the codes are widened to int16,
//              `q4_position`); `Q4Input` lays xq out.
//   q4a8_nk    (int4.h) symmetric w as q4_nk with groups of 32, x quantized here to int8 per block of 32 inputs
//              (w4a8: GGUF Q4_0 x Q8_0): y f32 = sum_blocks ws * xs_block * ((codes - 8) . xq_block).
// int8_nk, q4_nk and q4a8_nk are called through one handler (weight_only_matmul), i8i8_nk through another; each
// takes one or several weights sharing their activation rows and splits all of their rows over the threads as
// one job (`split_rows`).
//
// ISA levels (pallas_kernels/cpu_features.py): avx2 builds every kernel on 256-bit vectors; avx512_vnni adds
// 512-bit variants of int8_nk, i8i8_nk, q4_nk and q4a8_nk (vpdpwssd / vpdpbusd; same integer sums, f32 totals
// added in another order) and builds the rest with 32 vector registers; amx adds Intel AMX tile variants (amx.h) of
// float_kn / float_nk for bf16 weights with bf16 activations and of i8i8_nk (from 6 rows), int8_nk (from 4 rows)
// and q4_nk (from 16 rows, K <= 1024), more than 16 rows in blocks of 16; the rest as avx512_vnni.
#include <immintrin.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

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
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"
#include "threads.h"
#include "float.h"
#include "int4.h"
#include "int8.h"
#include "amx.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_gemv::at_layer;
using jaxinfer_gemv::A8Pair;
using jaxinfer_gemv::float_kn_rows;
using jaxinfer_gemv::i16_rows;
using jaxinfer_gemv::i8_rows;
using jaxinfer_gemv::nk_rows;
using jaxinfer_gemv::a8_pairs;
using jaxinfer_gemv::q4a8_rows;
using jaxinfer_gemv::load8;
using jaxinfer_gemv::max_threads;
using jaxinfer_gemv::parallel_chunks;
using jaxinfer_gemv::rows_per_chunk;
using jaxinfer_gemv::to_f32;

#if !defined(__AVX2__) || !defined(__FMA__)
#error "gemv.cc needs AVX2 and FMA (build.py passes -mavx2 -mfma)"
#endif

using jaxinfer_gemv::kPrefetchBytes;

// The rows of several weights (N_i each) over the threads as one job: chunks of about the rows per chunk the
// whole job would get, in weight order; f(i, n0, n1) computes rows [n0, n1) of weight i.
template <typename F>
void split_rows(const std::vector<int64_t>& Ns, const F& f) {
  int64_t total = 0;
  for (int64_t n : Ns) total += n;
#ifdef JAXINFER_AMX
  constexpr int64_t align = 16;  // nk_amx's strips
#else
  constexpr int64_t align = 8;
#endif
  int64_t rows = rows_per_chunk(total, align, 16), chunks = 0;
  std::vector<int64_t> per(Ns.size()), first(Ns.size());
  for (size_t i = 0; i < Ns.size(); ++i) {
    per[i] = std::min(rows, (Ns[i] + align - 1) / align * align), first[i] = chunks;
    chunks += (Ns[i] + per[i] - 1) / per[i];
  }
  parallel_chunks(chunks, [&](int64_t c) {
    size_t i = 0;
    while (i + 1 < Ns.size() && c >= first[i + 1]) ++i;
    int64_t n0 = (c - first[i]) * per[i];
    f(i, n0, std::min(Ns[i], n0 + per[i]));
  });
}

// ---------------------------------------------------------------------------------------------------------------
// FFI handlers. Shapes are checked in Python (pallas_kernels/cpu_gemv/__init__.py); the handlers check ranks.
// Weights arrive stacked, [L, ...] (L = 1 for a single layer's array), with the layer to read as an int32 scalar
// operand: a scanned model passes the whole stack and its loop index, so no slice of the stack is ever copied.
ffi::Error rank3(const ffi::AnyBuffer& b, const char* name) {
  if (b.dimensions().size() != 3) return ffi::Error::InvalidArgument(std::string(name) + " must be [L, rows, cols]");
  return ffi::Error::Success();
}

// The weights of a multi-weight call: `per` arguments a weight (its values first, each a stacked [L, ...] buffer)
// and one result of type R each; f(i, arguments of weight i, its result) reads them. Checks the counts, the
// buffers and their ranks.
template <ffi::DataType R, typename F>
ffi::Error for_each_weight(const ffi::RemainingArgs& args, const ffi::RemainingRets& outs, size_t per,
                           const char* kernel, const F& f) {
  std::string name(kernel);
  if (outs.size() == 0 || args.size() != per * outs.size())
    return ffi::Error::InvalidArgument(name + ": " + std::to_string(per) + " weight argument(s) a result");
  for (size_t i = 0; i < outs.size(); ++i) {
    std::vector<ffi::AnyBuffer> a;
    for (size_t j = 0; j < per; ++j) {
      auto b = args.get<ffi::AnyBuffer>(per * i + j);
      if (!b.has_value()) return ffi::Error::InvalidArgument(name + ": weight arguments must be buffers");
      if (auto e = rank3(*b, "weights"); e.failure()) return e;
      a.push_back(*b);
    }
    auto y = outs.get<ffi::Buffer<R>>(i);
    if (!y.has_value()) return ffi::Error::InvalidArgument(name + ": a result of the wrong type");
    if (auto e = f(i, a, (*y)->typed_data()); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// One or several weights (bf16 or f32, [K, N_i] with `kn`, else [N_i, K]) times the same rows x [M, K] into
// y_i [M, N_i], as one job. kn: each weight's K is cut into the same blocks as for one weight alone (so the sums
// do not depend on how many weights share the call), each block into a partial sum, added in block order.
struct FloatPart {
  const void* w;
  bool bf16;
  int64_t N;
  float* y;
};

template <typename T>
void float_kn_part(const float* x, int64_t M, int64_t K, const FloatPart& p, float* partial, int64_t k0, int64_t k1) {
  float_kn_rows(x, M, K, static_cast<const T*>(p.w), p.N, partial, k0, k1);
}

void float_call(const float* x, int64_t M, int64_t K, const std::vector<FloatPart>& parts, bool kn) {
  if (kn) {
    int64_t threads = max_threads();
    int64_t rows = std::max<int64_t>(64, (K / (2 * threads) + 3) / 4 * 4);
    int64_t blocks = (K + rows - 1) / rows;
    std::vector<int64_t> offset(parts.size() + 1, 0);
    for (size_t i = 0; i < parts.size(); ++i) offset[i + 1] = offset[i] + blocks * M * parts[i].N;
    std::vector<float> partial(offset.back());
    parallel_chunks(int64_t(parts.size()) * blocks, [&](int64_t c) {
      const FloatPart& p = parts[c / blocks];
      int64_t b = c % blocks, k0 = b * rows, k1 = std::min(K, k0 + rows);
      float* out = partial.data() + offset[c / blocks] + b * M * p.N;
      if (p.bf16) float_kn_part<uint16_t>(x, M, K, p, out, k0, k1);
      else float_kn_part<float>(x, M, K, p, out, k0, k1);
    });
    for (size_t i = 0; i < parts.size(); ++i) {
      const float* sums = partial.data() + offset[i];
      int64_t size = M * parts[i].N;
      std::copy(sums, sums + size, parts[i].y);
      for (int64_t b = 1; b < blocks; ++b)
        for (int64_t j = 0; j < size; ++j) parts[i].y[j] += sums[b * size + j];
    }
    return;
  }
  std::vector<int64_t> Ns;
  for (const FloatPart& p : parts) Ns.push_back(p.N);
  split_rows(Ns, [&](size_t i, int64_t n0, int64_t n1) {
    const FloatPart& p = parts[i];
    if (p.bf16) nk_rows(x, M, K, static_cast<const uint16_t*>(p.w), p.y, p.N, n0, n1);
    else nk_rows(x, M, K, static_cast<const float*>(p.w), p.y, p.N, n0, n1);
  });
}

#ifdef JAXINFER_AMX
// The amx level's bf16 x bf16 products (amx.h), when the activations and every weight are bf16 and, for [N, K]
// weights, K is a multiple of 32; false (nothing done) otherwise. Rows in blocks of at most 16
// (`tile_row_blocks`). [K, N]: the same block split as float_call, in blocks of a multiple of 32 rows; [N, K]:
// 16-row strips, any rows left over on the 256-bit path.
bool amx_float_call(const ffi::AnyBuffer& x, int64_t M, int64_t K, const std::vector<FloatPart>& parts, bool kn,
                    const float* xf) {
  if (x.element_type() != ffi::BF16 || M < jaxinfer_gemv::kAmxMinRowsFloat || (!kn && K % 32) ||
      !jaxinfer_gemv::amx_permitted())
    return false;
  for (const FloatPart& p : parts)
    if (!p.bf16) return false;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto row_blocks = jaxinfer_gemv::tile_row_blocks(M);
  if (!kn) {
    std::vector<std::vector<uint16_t>> packed;
    for (auto [m0, rows] : row_blocks) packed.push_back(jaxinfer_gemv::pack_columns(xb + m0 * K, rows, K));
    std::vector<int64_t> Ns;
    for (const FloatPart& p : parts) Ns.push_back(p.N);
    split_rows(Ns, [&](size_t i, int64_t n0, int64_t n1) {
      const FloatPart& p = parts[i];
      const uint16_t* w = static_cast<const uint16_t*>(p.w);
      int64_t tiled = n0 + (n1 - n0) / 16 * 16;
      for (size_t r = 0; r < row_blocks.size(); ++r)
        jaxinfer_gemv::nk_amx(packed[r].data(), row_blocks[r].second, K, w, p.y + row_blocks[r].first * p.N, p.N,
                              n0, tiled);
      if (tiled < n1) nk_rows(xf, M, K, w, p.y, p.N, tiled, n1);
    });
    return true;
  }
  int64_t Kp = (K + 31) / 32 * 32;
  std::vector<uint16_t> xp(M * Kp, 0);
  for (int64_t m = 0; m < M; ++m) std::copy(xb + m * K, xb + (m + 1) * K, xp.data() + m * Kp);
  int64_t rows = std::max<int64_t>(64, (K / (2 * max_threads()) + 31) / 32 * 32);
  int64_t blocks = (K + rows - 1) / rows;
  std::vector<int64_t> offset(parts.size() + 1, 0), N16(parts.size());
  for (size_t i = 0; i < parts.size(); ++i)
    N16[i] = (parts[i].N + 15) / 16 * 16, offset[i + 1] = offset[i] + blocks * M * N16[i];
  std::vector<float> partial(offset.back());
  parallel_chunks(int64_t(parts.size()) * blocks, [&](int64_t c) {
    size_t i = c / blocks;
    int64_t b = c % blocks, k0 = b * rows, k1 = std::min(K, k0 + rows);
    for (auto [m0, m] : row_blocks)
      jaxinfer_gemv::float_kn_amx(xp.data() + m0 * Kp, m, Kp, static_cast<const uint16_t*>(parts[i].w), parts[i].N,
                                  partial.data() + offset[i] + (b * M + m0) * N16[i], k0, k1);
  });
  for (size_t i = 0; i < parts.size(); ++i) {
    int64_t N = parts[i].N, size = M * N16[i];
    const float* sums = partial.data() + offset[i];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float v = sums[m * N16[i] + n];
        for (int64_t b = 1; b < blocks; ++b) v += sums[b * size + m * N16[i] + n];
        parts[i].y[m * N + n] = v;
      }
  }
  return true;
}
#endif

// Activations as f32 [M, K]: f32 ones in place, bf16 ones converted into `tmp`.
const float* activations_f32(const ffi::AnyBuffer& x, std::vector<float>& tmp) {
  if (x.element_type() == ffi::F32) return reinterpret_cast<const float*>(x.untyped_data());
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.untyped_data());
  tmp.resize(x.element_count());
  size_t i = 0;
  for (; i + 8 <= tmp.size(); i += 8) _mm256_storeu_ps(tmp.data() + i, load8(p + i));
  for (; i < tmp.size(); ++i) tmp[i] = to_f32(p[i]);
  return tmp.data();
}

ffi::Error check_activations(const ffi::AnyBuffer& x) {
  if (x.dimensions().size() != 2 || (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16))
    return ffi::Error::InvalidArgument("activations must be f32 or bf16 [M, K]");
  return ffi::Error::Success();
}

ffi::Error FloatMatmul(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                       ffi::RemainingRets outs, bool kn) {
  if (auto e = check_activations(x); e.failure()) return e;
  int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  std::vector<FloatPart> parts(outs.size());
  auto read = [&](size_t i, const std::vector<ffi::AnyBuffer>& w, float* y) {
    bool bf16 = w[0].element_type() == ffi::BF16;
    if (!bf16 && w[0].element_type() != ffi::F32) return ffi::Error::InvalidArgument("float_matmul: w must be bf16 or f32");
    parts[i] = {bf16 ? static_cast<const void*>(at_layer<uint16_t>(w[0], layer))
                     : static_cast<const void*>(at_layer<float>(w[0], layer)),
                bf16, kn ? w[0].dimensions()[2] : w[0].dimensions()[1], y};
    return ffi::Error::Success();
  };
  if (auto e = for_each_weight<ffi::F32>(weights, outs, 1, "float_matmul", read); e.failure()) return e;
  std::vector<float> tmp;
  const float* xf = activations_f32(x, tmp);
#ifdef JAXINFER_AMX
  if (amx_float_call(x, M, K, parts, kn, xf)) return ffi::Error::Success();
#endif
  float_call(xf, M, K, parts, kn);
  return ffi::Error::Success();
}

// Activation rows rounded to int16 (`int16_inverse`), in input order, with each row's scale: int8_nk's
// activations (q4_nk's are laid out by `q4_activations`).
std::vector<int16_t> int16_rows(const float* x, int64_t M, int64_t K, std::vector<float>& xs) {
  using jaxinfer_gemv::round_i16x8;
  std::vector<int16_t> q(M * K);
  xs.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    float inverse = jaxinfer_gemv::int16_inverse(r, K, xs[m]);
    const __m256 inv8 = _mm256_set1_ps(inverse);
    int16_t* out = q.data() + m * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {  // packs interleaves lanes: permute back to input order
      __m256i p = _mm256_packs_epi32(round_i16x8(r + k, inv8), round_i16x8(r + k + 8, inv8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permute4x64_epi64(p, 0xd8));
    }
    for (; k < K; ++k) out[k] = int16_t(std::max(-32767.f, std::min(32767.f, std::nearbyint(r[k] * inverse))));
  }
  return q;
}

// w8a8: one or several int8 weights [L, N_i, K] (after the activations and layer) times the same int8 rows; result
// i is int32 [M, N_i] (q, k and v, or gate and up, in one call).
ffi::Error I8I8Matmul(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                      ffi::RemainingRets outs) {
  int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  std::vector<const int8_t*> ws(outs.size());
  std::vector<int32_t*> ys(outs.size());
  std::vector<int64_t> Ns(outs.size());
  auto read = [&](size_t i, const std::vector<ffi::AnyBuffer>& w, int32_t* y) {
    ws[i] = at_layer<int8_t>(w[0], layer), ys[i] = y, Ns[i] = w[0].dimensions()[1];
    return ffi::Error::Success();
  };
  if (auto e = for_each_weight<ffi::S32>(weights, outs, 1, "i8i8_matmul", read); e.failure()) return e;
  std::vector<uint8_t> xu = jaxinfer_gemv::i8_unsigned(x.typed_data(), M * K);
#ifdef JAXINFER_AMX
  if (M >= jaxinfer_gemv::kAmxMinRowsI8I8 && K % 64 == 0 && jaxinfer_gemv::amx_permitted()) {
    const auto row_blocks = jaxinfer_gemv::tile_row_blocks(M);
    std::vector<std::vector<int8_t>> packed;
    for (auto [m0, rows] : row_blocks) packed.push_back(jaxinfer_gemv::pack_columns(x.typed_data() + m0 * K, rows, K));
    split_rows(Ns, [&](size_t i, int64_t n0, int64_t n1) {  // 16-row strips on tiles, the rest as below
      int64_t tiled = n0 + (n1 - n0) / 16 * 16;
      for (size_t r = 0; r < row_blocks.size(); ++r)
        jaxinfer_gemv::nk_amx(packed[r].data(), row_blocks[r].second, K, ws[i], ys[i] + row_blocks[r].first * Ns[i],
                              Ns[i], n0, tiled);
      if (tiled < n1) i8_rows(x.typed_data(), xu.data(), M, K, ws[i], ys[i], Ns[i], tiled, n1);
    });
    return ffi::Error::Success();
  }
#endif
  split_rows(Ns, [&](size_t i, int64_t n0, int64_t n1) {
    i8_rows(x.typed_data(), xu.data(), M, K, ws[i], ys[i], Ns[i], n0, n1);
  });
  return ffi::Error::Success();
}

// Weight-only int8 and int4 matmuls of one or several weights sharing their activation rows (q, k and v; gate and
// up): the rows are rounded to int16 once and all the weights' row chunks go to the threads as one job, so a
// decode layer makes four calls instead of seven (a call's start and end cost ~1-2 us each; the threads'
// chunks of one small weight leave the cores idle for a while). Per weight i, arguments values_i, scale_i and
// offset_i (int4's min, or the scale again where unused) follow the activations and layer; result i is
// f32 [M, N_i]. `bits`: 8 (int8_nk) or 4 (q4_nk); `symmetric`: int4 codes minus 8 (else the min);
// `int8_activations`: symmetric int4 with 32-input blocks times int8 activation blocks (q4a8_nk, w4a8).
ffi::Error WeightOnlyMatmul(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                            ffi::RemainingRets outs, int32_t bits, bool symmetric, bool int8_activations) {
  if (auto e = check_activations(x); e.failure()) return e;
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("weight_only_matmul: bits must be 8 or 4");
  int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  if (int8_activations && (bits != 4 || !symmetric || K % 64))
    return ffi::Error::InvalidArgument("weight_only_matmul: int8 activations need symmetric int4 codes, K % 64 == 0");
  struct Part { const void* w; const float *scale, *offset; int64_t N, G; float* y; };
  std::vector<Part> parts(outs.size());
  auto read = [&](size_t i, const std::vector<ffi::AnyBuffer>& a, float* y) {  // values, scale, offset
    Part& p = parts[i];
    p.N = a[0].dimensions()[1], p.G = a[1].dimensions()[2];
    if (p.G != parts[0].G && bits == 4 && !symmetric)
      return ffi::Error::InvalidArgument("weight_only_matmul: int4 weights with a min must share their groups");
    if (int8_activations && p.G * 32 != K)
      return ffi::Error::InvalidArgument("weight_only_matmul: int8 activations need one scale a 32-input block");
    p.w = bits == 8 ? static_cast<const void*>(at_layer<int8_t>(a[0], layer))
                    : static_cast<const void*>(at_layer<uint8_t>(a[0], layer));
    p.scale = at_layer<float>(a[1], layer), p.offset = at_layer<float>(a[2], layer), p.y = y;
    return ffi::Error::Success();
  };
  if (auto e = for_each_weight<ffi::F32>(weights, outs, 3, "weight_only_matmul", read); e.failure()) return e;
  std::vector<float> tmp, xs, xsum;
  const float* xf = activations_f32(x, tmp);
  std::vector<int16_t> xq = bits == 8 ? int16_rows(xf, M, K, xs) : std::vector<int16_t>();
  jaxinfer_gemv::Q4Input xp;  // q4_nk's activations in the layout the level and shape take
  if (bits == 4 && !int8_activations) xp = jaxinfer_gemv::Q4Input(xf, M, K, symmetric, parts[0].G, xs, xsum);
  std::vector<A8Pair> xa = int8_activations ? a8_pairs(xf, M, K) : std::vector<A8Pair>();
  std::vector<int64_t> Ns;
  for (const Part& p : parts) Ns.push_back(p.N);
#ifdef JAXINFER_AMX
  // int8 (from kAmxMinRowsInt8 rows) and int4 weight-only (from kAmxMinRowsInt4 rows and up to kAmxMaxKInt4 inputs,
  // all weights with the same groups) on tiles (amx.h, weight_only_amx) when every weight's groups are a multiple
  // of 32 inputs: the int16 rows split into their high and low bytes, packed as tile B once a call; rows past the
  // last 16-row strip as below
  const bool q4 = bits == 4 && !int8_activations;
  int64_t step = 0;
  if (((bits == 8 && M >= jaxinfer_gemv::kAmxMinRowsInt8) || (q4 && M >= jaxinfer_gemv::kAmxMinRowsInt4 &&
                                                               K <= jaxinfer_gemv::kAmxMaxKInt4)) &&
      jaxinfer_gemv::amx_permitted()) {
    step = 64;
    for (const Part& p : parts) {
      step = std::min<int64_t>(step, (K / p.G) % 64 == 0 ? 64 : (K / p.G) % 32 == 0 ? 32 : 0);
      if (q4 && p.G != parts[0].G) step = 0;
    }
  }
  jaxinfer_gemv::TileActivations xt;
  if (step) {
    std::vector<float> same;  // q4: the int16 rows, rounded as q4_activations rounded them (the same scales)
    if (q4) xq = int16_rows(xf, M, K, same);
    xt = jaxinfer_gemv::tile_activations(xq.data(), xsum.data(), M, K, parts[0].G, step, q4);
  }
#endif
  split_rows(Ns, [&](size_t i, int64_t n0, int64_t n1) {
    const Part& p = parts[i];
#ifdef JAXINFER_AMX
    if (step) {
      int64_t tiled = n0 + (n1 - n0) / 16 * 16;
      for (size_t r = 0; r < xt.blocks.size(); ++r) {
        auto [m0, rows] = xt.blocks[r];
        auto kernel = q4 ? jaxinfer_gemv::weight_only_amx<true> : jaxinfer_gemv::weight_only_amx<false>;
        kernel(xt.hi[r].data(), xt.lo[r].data(), q4 ? xt.xsum_t[r].data() : nullptr, rows, K, p.w, p.scale, p.offset,
               symmetric, p.G, step, p.y + m0 * p.N, p.N, n0, tiled);
      }
      if (tiled < n1 && q4)
        xp.rows(xsum.data(), M, K, static_cast<const uint8_t*>(p.w), p.scale, p.offset, symmetric, p.G,
                p.y, p.N, tiled, n1);
      else if (tiled < n1)
        i16_rows(xq.data(), M, K, static_cast<const int8_t*>(p.w), p.scale, p.G, p.y, p.N, tiled, n1);
      return;
    }
#endif
    if (int8_activations)
      q4a8_rows(xa.data(), M, K, static_cast<const uint8_t*>(p.w), p.scale, p.y, p.N, n0, n1);
    else if (bits == 8)
      i16_rows(xq.data(), M, K, static_cast<const int8_t*>(p.w), p.scale, p.G, p.y, p.N, n0, n1);
    else
      xp.rows(xsum.data(), M, K, static_cast<const uint8_t*>(p.w), p.scale, p.offset, symmetric, p.G,
              p.y, p.N, n0, n1);
  });
  if (!int8_activations)  // q4a8_nk applies the activation scales itself
    for (const Part& p : parts)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < p.N; ++n) p.y[m * p.N + n] *= xs[m];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_float_matmul, FloatMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("kn"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_i8i8_matmul, I8I8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_weight_only_matmul, WeightOnlyMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("bits")
                                  .Attr<bool>("symmetric")
                                  .Attr<bool>("int8_activations"));

// Diagnostics of the thread pool (tests/pallas_kernels/test_cpu_gemv.py): runs `count` chunks through it from the
// calling thread, each busy for `chunk_us` microseconds, and records per chunk the CPU it ran on (`cpu` [count])
// and its thread id (`tid` [count]). Returns the threads a call may use, the caller included.
extern "C" int64_t jaxinfer_threads_probe(int64_t count, int64_t chunk_us, int32_t* cpu, int64_t* tid) {
  parallel_chunks(count, [&](int64_t c) {
    auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(chunk_us);
    while (std::chrono::steady_clock::now() < end) _mm_pause();
    cpu[c] = sched_getcpu();
    tid[c] = int64_t(syscall(SYS_gettid));
  });
  return max_threads();
}
