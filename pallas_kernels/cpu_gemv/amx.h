// The amx level's kernels (gemv.cc; build.py's flags for the level): Intel AMX tile matmuls from 4-16 activation
// rows on (more than 16 in blocks of 16), where the 512-bit dot products of the avx512_vnni level run out of
// arithmetic as the rows grow (a row more costs them one more dot per weight vector; a tile op takes up to 16 rows
// at the same cost). Below `kAmxMinRows*` rows the avx512_vnni kernels stay faster and run.
//
//   float_kn_amx  bf16 x [M, K] times bf16 w [K, N] (input-major): x is tile A (M rows x 32 inputs) and each
//                 16-column strip of 32 weight rows tile B, its rows interleaved in pairs (k, k + 1) as
//                 tdpbf16ps wants them (`pack_pairs`, one 512-bit permute per 32 weights, 256 columns at a time
//                 into an L1-resident buffer), the partial sums [M, N] tile C.
//   nk_amx        w [N, K] row-major (a tied embedding as LM head in bf16, w8a8's int8 weights) times x: the
//                 transposed product y.T = w . x.T, so 16 weight rows load as tile A in place (no repacking: each
//                 row is 64 contiguous bytes at the weight's row stride) and the activations, laid out once a call
//                 in pairs (bf16) or fours (int8) of inputs (`pack_columns`), are tile B; tile C is 16 outputs x M
//                 rows. bf16: tdpbf16ps; int8: tdpbssd (signed x signed, exact int32 sums as the other levels).
//   weight_only_amx  int8 weight-only (i16_amx): nk_amx's layout, the int16-rounded activations split into bytes;
//                 int4 weight-only (q4_amx) the same with each 64-input chunk of codes unpacked into bytes as tile A.
//
// Sums: tdpbf16ps multiplies bf16 exactly and adds in f32 (denormal inputs count as zero, denormal results flush
// to zero: Intel SDM, "TDPBF16PS"), in its own order; tdpbssd's int32 sums are exact and wrap as the others.
//
// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM; kernel 5.16 and
// later): `amx_permitted` asks once; where it is refused every kernel takes its avx512_vnni path. Each chunk of
// work configures the tiles on its thread and releases them at its end (a thread holding tile state makes each
// context switch save 8 KiB more).
#ifndef JAXINFER_CPU_GEMV_AMX_H_
#define JAXINFER_CPU_GEMV_AMX_H_

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define JAXINFER_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

namespace jaxinfer_gemv {

constexpr int64_t kAmxMaxRows = 16;  // activation rows a tile takes
// Rows from which each tile kernel beats the avx512_vnni level's (below them the tiles' fixed cost, ~the same at 1
// and 8 rows, loses): a SmolLM2 layer's calls (scripts/kernel_layers.py, Emerald Rapids, 2 cores) took with tiles
// bf16 1.82 / 1.49 / 1.12 / 0.86 / 0.73x the time at 1 / 2 / 4 / 6 / 8 rows, w8a8 1.18 / 1.08 / 1.06 / 0.83 /
// 0.76x, int8 weight-only 1.07 / 0.96 / 0.83 / - / 0.59x. (int4 with its codes unpacked into tile A took
// 1.0-1.6x the time even at 8 rows, its 32-input groups each a fold of two tiles into f32: q4_amx runs from 16
// rows, below.)
constexpr int64_t kAmxMinRowsFloat = 6, kAmxMinRowsI8I8 = 6, kAmxMinRowsInt8 = 4;
// int4 weight-only on tiles (q4_amx) from 16 rows and up to 1,024 inputs: against the avx512_vnni kernels (session
// 27, scripts/kernel_layers.py int4) 1.0-1.7x faster at 16 rows and 1.4-2.5x at 32 for K = 576, but at K = 1536
// (its tile B rows then outgrow L1) 1.27x / 1.45x where the 512-bit kernel's four-row blocks gained 1.76x / 1.84x.
constexpr int64_t kAmxMinRowsInt4 = 16, kAmxMaxKInt4 = 1024;

// More rows than a tile takes run as blocks of rows, each its own pass of the kernel over the weight rows of a
// chunk (the second pass finds them in L2): ceil(M / 16) blocks of near-equal size, as (first row, rows) pairs.
inline std::vector<std::pair<int64_t, int64_t>> tile_row_blocks(int64_t M) {
  const int64_t count = (M + kAmxMaxRows - 1) / kAmxMaxRows, per = (M + count - 1) / count;
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t m0 = 0; m0 < M; m0 += per) blocks.emplace_back(m0, std::min(per, M - m0));
  return blocks;
}

// Whether this process may use the AMX tiles (asked once; Linux's ARCH_REQ_XCOMP_PERM for XTILEDATA).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// A tile configuration (palette 1): `shape[t]` = {rows, bytes a row} of tile t, unused tiles zero.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int r, int bytes) { rows[t] = uint8_t(r), colsb[t] = uint16_t(bytes); }
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

// Configures the tiles for one chunk of work and releases them when it ends.
class Tiles {
 public:
  explicit Tiles(const TileConfig& c) { _tile_loadconfig(&c); }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// ---------------------------------------------------------------------------------------------------------------
// float_kn_amx. Rows [k, k + 32) of w [K, N], columns [c0, c1) (c0 a multiple of 32; rows at or past `k_end` read
// as zero) into `buf`: per 16-column strip s of them, 16 rows of 64 bytes, row p holding (w[k + 2p, n],
// w[k + 2p + 1, n]) for the strip's 16 columns n (columns past c1 zero), i.e. tile B of tdpbf16ps.
inline void pack_pairs(const uint16_t* w, int64_t N, int64_t k, int64_t k_end, int64_t c0, int64_t c1,
                       uint16_t* buf) {
  alignas(64) static const int16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);  // the pairs of columns 0-15 of rows a and b
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t strips = (c1 - c0 + 15) / 16;
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t r0 = k + 2 * p, r1 = r0 + 1;
    const uint16_t* a = w + r0 * N;
    const uint16_t* b = w + r1 * N;
    uint16_t* out = buf + p * 32;
    for (int64_t n = c0; n < c1; n += 32) {
      const int64_t s = (n - c0) / 16;
      __mmask32 mask = c1 - n >= 32 ? _cvtu32_mask32(~0u) : _cvtu32_mask32((1u << (c1 - n)) - 1u);
      if (r0 < k_end) _mm_prefetch(reinterpret_cast<const char*>(a + n) + kPrefetchBytes, _MM_HINT_T0);
      if (r1 < k_end) _mm_prefetch(reinterpret_cast<const char*>(b + n) + kPrefetchBytes, _MM_HINT_T0);
      __m512i va = r0 < k_end ? _mm512_maskz_loadu_epi16(mask, a + n) : _mm512_setzero_si512();
      __m512i vb = r1 < k_end ? _mm512_maskz_loadu_epi16(mask, b + n) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + s * 512, _mm512_permutex2var_epi16(va, lo, vb));
      if (s + 1 < strips) _mm512_storeu_si512(out + (s + 1) * 512, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// Rows [k0, k1) of w into the partial sums y [M, N16] (N16 = N rounded up to 16; zeroed here), x bf16 [M, Kp]
// with Kp a multiple of 32 (zero past K), k0 a multiple of 32, M <= 16. Each 32-row step goes through the columns
// in chunks of kStrips strips, packed into an L1-resident buffer; two tile C / tile B pairs alternate, so
// consecutive strips' tile ops do not wait on each other.
inline void float_kn_amx(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* w, int64_t N, float* y,
                         int64_t k0, int64_t k1) {
  constexpr int64_t kStrips = 16;  // 256 columns: 16 KiB of tile B
  const int64_t strips = (N + 15) / 16, N16 = strips * 16;
  std::fill(y, y + M * N16, 0.f);
  alignas(64) uint16_t buf[kStrips * 512];
  TileConfig c;
  c.set(0, int(M), 64);  // A: x
  c.set(1, int(M), 64);  // C: 16 partial sums a row (two, alternating)
  c.set(3, int(M), 64);
  c.set(2, 16, 64);      // B: a strip's 16 pairs of rows (two, alternating)
  c.set(4, 16, 64);
  Tiles tiles(c);
  for (int64_t k = k0; k < k1; k += 32) {
    _tile_loadd(0, x + k, Kp * 2);
    for (int64_t s0 = 0; s0 < strips; s0 += kStrips) {
      const int64_t s1 = std::min(strips, s0 + kStrips);
      pack_pairs(w, N, k, k1, 16 * s0, std::min(N, 16 * s1), buf);
      int64_t s = s0;
      for (; s + 2 <= s1; s += 2) {
        float* ya = y + s * 16;
        float* yb = ya + 16;
        _tile_loadd(1, ya, N16 * 4);
        _tile_loadd(2, buf + (s - s0) * 512, 64);
        _tile_loadd(3, yb, N16 * 4);
        _tile_loadd(4, buf + (s + 1 - s0) * 512, 64);
        _tile_dpbf16ps(1, 0, 2);
        _tile_dpbf16ps(3, 0, 4);
        _tile_stored(1, ya, N16 * 4);
        _tile_stored(3, yb, N16 * 4);
      }
      if (s < s1) {
        _tile_loadd(1, y + s * 16, N16 * 4);
        _tile_loadd(2, buf + (s - s0) * 512, 64);
        _tile_dpbf16ps(1, 0, 2);
        _tile_stored(1, y + s * 16, N16 * 4);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// nk_amx, i16_amx. The activations as tile B of the transposed product: for each `step` bytes of K (64: 32 bf16
// or 64 int8 inputs; 32 for int8 groups of 32 inputs), step / 4 rows of M groups of 4 / sizeof(T) consecutive
// inputs (pairs of bf16, fours of int8), M x 4 bytes a row.
template <typename T>
std::vector<T> pack_columns(const T* x, int64_t M, int64_t K, int64_t step = 64) {
  constexpr int64_t G = 4 / sizeof(T);
  const int64_t per = step / sizeof(T), rows = step / 4;
  std::vector<T> b(K / per * rows * M * G);
  for (int64_t s = 0; s < K / per; ++s)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(&b[((s * rows + r) * M + m) * G], x + m * K + s * per + r * G, 4);
  return b;
}

// Weight rows [n0, n1) of w [N, K] (n1 - n0 a multiple of 16, K a multiple of 64 bytes) times the packed
// activations `xb` (`pack_columns`) into y [M, N]: f32 sums (bf16 w) or exact int32 sums (int8 w). Four strips of
// 16 rows at a time share each tile B load and keep four independent tile C chains.
template <typename T, typename R>
void nk_amx(const T* xb, int64_t M, int64_t K, const T* w, R* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t kStep = 64 / sizeof(T);
  const int64_t steps = K / kStep;
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.set(t, 16, int(4 * M));  // C: 16 outputs x M rows
  c.set(4, 16, 64);                                      // A: 16 weight rows x 64 bytes (two, alternating)
  c.set(5, 16, 64);
  c.set(6, 16, int(4 * M));                              // B: the activations
  Tiles tiles(c);
  alignas(64) R out[16 * kAmxMaxRows];
  auto store = [&](int64_t n) {  // tile C (16 outputs x M rows) into y's columns [n, n + 16)
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t m = 0; m < M; ++m) y[m * N + n + r] = out[r * M + m];
  };
  int64_t n = n0;
  for (; n + 64 <= n1; n += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const T* rows = w + n * K;
    for (int64_t s = 0; s < steps; ++s) {
      const T* a = rows + s * kStep;
      for (int64_t r = 64; r < 128; ++r)  // the next 64 rows' lines at this step: one group ahead
        _mm_prefetch(reinterpret_cast<const char*>(a + r * K), _MM_HINT_T0);
      _tile_loadd(6, xb + s * 16 * M * (4 / sizeof(T)), 4 * M);
#define JAXINFER_NK_STRIP(t, at)                                           \
      _tile_loadd(at, a + (t) * 16 * K, K * sizeof(T));                    \
      if constexpr (sizeof(T) == 2) _tile_dpbf16ps(t, at, 6);              \
      else _tile_dpbssd(t, at, 6);
      JAXINFER_NK_STRIP(0, 4)
      JAXINFER_NK_STRIP(1, 5)
      JAXINFER_NK_STRIP(2, 4)
      JAXINFER_NK_STRIP(3, 5)
#undef JAXINFER_NK_STRIP
    }
    _tile_stored(0, out, 4 * M);
    store(n);
    _tile_stored(1, out, 4 * M);
    store(n + 16);
    _tile_stored(2, out, 4 * M);
    store(n + 32);
    _tile_stored(3, out, 4 * M);
    store(n + 48);
  }
  for (; n + 16 <= n1; n += 16) {
    _tile_zero(0);
    const T* rows = w + n * K;
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(6, xb + s * 16 * M * (4 / sizeof(T)), 4 * M);
      _tile_loadd(4, rows + s * kStep, K * sizeof(T));
      if constexpr (sizeof(T) == 2) _tile_dpbf16ps(0, 4, 6);
      else _tile_dpbssd(0, 4, 6);
    }
    _tile_stored(0, out, 4 * M);
    store(n);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// weight_only_amx<false> (int8_nk, "i16_amx") and <true> (q4_nk, "q4_amx") on tiles. The activations, rounded
// to int16 per row as on the other levels, are split into bytes, x = 256 h + l (h signed, l unsigned; `hi`, `lo`
// packed by pack_columns with `step` bytes a tile step: 64, or 32 for groups of 32 inputs), and each 16-row strip
// of weights (tile A) multiplies both into two int32 tiles: int8 weights load in place (tdpbssd, tdpbsud); int4
// codes are unpacked, each 64-input chunk of a row (32 bytes, input 2j in the low nibble of byte j) once into 64
// unsigned bytes ordered [low nibbles of bytes 0-15, their high nibbles, low nibbles of bytes 16-31, their high
// nibbles] (`q4_order`: each 32-input block stays whole in its half; the activations are packed in that order), then
// tdpbusd, tdpbuud. At each group end (and every 16,384 inputs: no int32 overflows) the two sums go to f32 as
// 256 h-sum + l-sum, times the group's scale, into the totals; int4 adds its correction there: -8 x scale
// (symmetric codes) or the min, times the group's rounded input sum (`xsum_t` [G, 16]: per group, the rows' sums).
// Weight rows [n0, n1), n1 - n0 a multiple of 16, groups of a multiple of `step` inputs; y f32 [M, N] before the
// rows' activation scales.
//
// The input a position of a 64-input chunk holds in q4_order (its own inverse is not needed: the activations are
// gathered through it).
inline int64_t q4_order(int64_t p) {
  const int64_t block = p / 32, q = p % 32;
  return 32 * block + (q < 16 ? 2 * q : 2 * (q - 16) + 1);
}

template <bool kInt4>
void weight_only_amx(const int8_t* hi, const uint8_t* lo, const float* xsum_t, int64_t M, int64_t K, const void* w,
                     const float* scale, const float* offset, bool symmetric, int64_t G, int64_t step, float* y,
                     int64_t N, int64_t n0, int64_t n1) {
  const int64_t group = K / G, span = std::min<int64_t>(group, 16384), rows = step / 4;
  const int8_t* w8 = static_cast<const int8_t*>(w);
  const uint8_t* w4 = static_cast<const uint8_t*>(w);
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.set(t, 16, int(4 * M));  // C: h and l sums of two strips
  c.set(4, 16, int(step));                                // A: the two strips' weights
  c.set(5, 16, int(step));
  c.set(6, int(rows), int(4 * M));                        // B: h, l
  c.set(7, int(rows), int(4 * M));
  Tiles tiles(c);
  const __mmask16 lanes = _cvtu32_mask16((1u << M) - 1u);
  const __m512 f256 = _mm512_set1_ps(256.f);
  alignas(64) int32_t sh[16 * kAmxMaxRows], sl[16 * kAmxMaxRows];
  alignas(64) float total[32][kAmxMaxRows];
  alignas(64) uint8_t codes[32][64];  // int4: the two strips' unpacked chunk
  auto unpack = [&](int64_t n, int64_t chunk, int64_t count) {  // int4 rows [n, n + count) of chunk `chunk`
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* src = w4 + (n + r) * (K / 2) + 32 * chunk;
      _mm_prefetch(reinterpret_cast<const char*>(src + 16 * K), _MM_HINT_T0);  // the next two strips' line
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      __m256i l4 = _mm256_and_si256(v, low4), h4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[r]), _mm256_permute2x128_si256(l4, h4, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[r] + 32), _mm256_permute2x128_si256(l4, h4, 0x31));
    }
  };
  auto fold = [&](bool second, int64_t n, int64_t g, bool last, float* t) {  // a strip's sums into its totals
    if (second) {
      _tile_stored(2, sh, 4 * M);
      _tile_stored(3, sl, 4 * M);
    } else {
      _tile_stored(0, sh, 4 * M);
      _tile_stored(1, sl, 4 * M);
    }
    for (int64_t r = 0; r < 16; ++r) {
      const float s = scale[(n + r) * G + g];
      __m512 v = _mm512_fmadd_ps(f256, _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, sh + r * M)),
                                 _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, sl + r * M)));
      __m512 acc = _mm512_fmadd_ps(v, _mm512_set1_ps(s), _mm512_maskz_loadu_ps(lanes, t + r * kAmxMaxRows));
      if (kInt4 && last)
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, xsum_t + g * kAmxMaxRows),
                              _mm512_set1_ps(symmetric ? -8.f * s : offset[(n + r) * G + g]), acc);
      _mm512_mask_storeu_ps(t + r * kAmxMaxRows, lanes, acc);
    }
  };
  for (int64_t n = n0; n < n1; n += 32) {
    const bool two = n + 32 <= n1;
    std::fill(&total[0][0], &total[0][0] + 32 * kAmxMaxRows, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += span) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t k1 = std::min(k0 + span, (g + 1) * group);
        for (int64_t k = k0; k < k1; k += step) {
          if (kInt4 && k % 64 == 0) unpack(n, k / 64, two ? 32 : 16);
          if (!kInt4 && k % 64 == 0)  // the next two strips' lines at this step
            for (int64_t r = 32; r < 64; ++r)
              _mm_prefetch(reinterpret_cast<const char*>(w8 + (n + r) * K + k), _MM_HINT_T0);
          _tile_loadd(6, hi + k / step * rows * M * 4, 4 * M);
          _tile_loadd(7, lo + k / step * rows * M * 4, 4 * M);
          if constexpr (kInt4) {
            _tile_loadd(4, codes[0] + k % 64, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbuud(1, 4, 7);
          } else {
            _tile_loadd(4, w8 + n * K + k, K);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
          }
          if (!two) continue;
          if constexpr (kInt4) {
            _tile_loadd(5, codes[16] + k % 64, 64);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbuud(3, 5, 7);
          } else {
            _tile_loadd(5, w8 + (n + 16) * K + k, K);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
          }
        }
        const bool last = k1 == (g + 1) * group;
        fold(false, n, g, last, total[0]);
        if (two) fold(true, n + 16, g, last, total[16]);
      }
    for (int64_t r = 0; r < (two ? 32 : 16); ++r)
      for (int64_t m = 0; m < M; ++m) y[m * N + n + r] = total[r][m];
  }
}

// The activations of i16_amx / q4_amx for each block of rows (`tile_row_blocks`): the int16 rows xq [M, K] split
// into their high and low bytes (q4: in q4_order within each 64-input chunk), packed as tile B with `step` bytes a
// tile step; q4 also the block's rows' sums of rounded inputs per group, [G, 16] (from `xsum` [M, G]).
struct TileActivations {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  std::vector<std::vector<int8_t>> hi;
  std::vector<std::vector<uint8_t>> lo;
  std::vector<std::vector<float>> xsum_t;
};

inline TileActivations tile_activations(const int16_t* xq, const float* xsum, int64_t M, int64_t K, int64_t G,
                                        int64_t step, bool q4) {
  TileActivations t;
  t.blocks = tile_row_blocks(M);
  std::vector<int8_t> xh(M * K);
  std::vector<uint8_t> xl(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const int16_t v = xq[m * K + (q4 ? k / 64 * 64 + q4_order(k % 64) : k)];
      xh[m * K + k] = int8_t(v >> 8), xl[m * K + k] = uint8_t(v & 0xff);
    }
  for (auto [m0, rows] : t.blocks) {
    t.hi.push_back(pack_columns(xh.data() + m0 * K, rows, K, step));
    t.lo.push_back(pack_columns(xl.data() + m0 * K, rows, K, step));
    if (!q4) continue;
    std::vector<float> sums(G * kAmxMaxRows, 0.f);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t g = 0; g < G; ++g) sums[g * kAmxMaxRows + m] = xsum[(m0 + m) * G + g];
    t.xsum_t.push_back(std::move(sums));
  }
  return t;
}

}  // namespace jaxinfer_gemv

#endif  // AMX
#endif  // JAXINFER_CPU_GEMV_AMX_H_
