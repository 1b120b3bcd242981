// Paged decode attention on x86 CPUs (AVX2 + FMA), called from jitted JAX code through XLA's FFI: every sequence
// of a ragged batch has a few new query rows (decode: one; a speculative verify window: a few) attending over its
// paged KV context, read in place from the stacked cache [L, P, K, page_size, H] at a traced layer index. Same
// semantics as pallas_kernels/paged_attention/reference.py (`paged_attention_reference`); the Python wrapper is
// pallas_kernels/cpu_gemv/paged_attention.py.
//
// Decode attention reads each sequence's context once and does ~2 FMAs per query row per cached value, so the
// kernel is built to read the context once: keys and values are visited one tile of at most kTile positions at a
// time (gathered across page boundaries, prefetched kPrefetchTokens ahead), converted to f32 once into a per-thread
// scratch that stays in L1, and every query row of the kv head (G heads x q_len tokens, GQA) works on that tile
// while it is hot. The softmax is FlashAttention's online one, in f32 (Dao et al. 2022): per row a running max m,
// sum l and output acc. As in the reference, the probabilities are rounded to the values' dtype (bf16 pages, or
// quantized ones with bf16 queries) before they weight the values.
//
// Work split (flash-decoding, Dao et al. 2023): one work item per (sequence, kv head, span of kSplitTokens
// context positions). Spans sit at fixed multiples of kSplitTokens, so the partial results, and their combine in
// span order afterwards, do not depend on the number of threads: the output is deterministic.
//
// At the 512-bit levels the score and value sums take the G query rows of a kv head through each key together in
// 16-lane FMAs (`scores512`, `pv512`), and bf16 pages convert 16 values at a time: measured (session 28, SmolLM2's
// shapes, bf16 pages, 30 layers) 1.06-1.07x the 256-bit code's speed; most of the rest of a call is the gathers'
// loads of the pages (the context read from L3 / DRAM at ~15 GB/s), which neither changes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"
#include "threads.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_gemv::at_layer;
using jaxinfer_gemv::exp8;
using jaxinfer_gemv::load8;
using jaxinfer_gemv::parallel_chunks;
using jaxinfer_gemv::to_bf16;
using jaxinfer_gemv::to_f32;

#if !defined(__AVX2__) || !defined(__FMA__)
#error "paged_attention.cc needs AVX2 and FMA (build.py passes -mavx2 -mfma)"
#endif

constexpr int64_t kSplitTokens = 256;  // context positions per work item
constexpr int64_t kTile = 32;          // keys per tile (fewer at page ends)
constexpr int64_t kPrefetchTokens = 64;  // how far ahead of the tile in use to prefetch keys and values
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------------------------
// Page values as f32. Quantized pages (int8; fp8 e4m3fn bit patterns in uint8) give their unscaled values, exactly;
// their per-token scales are applied to the scores and probabilities (the reference's rule).
struct Fp8Table {
  float v[256];
  Fp8Table() {  // sign | 4 exponent bits (bias 7) | 3 mantissa bits; as `kv_quant.load_values` decodes them
    for (int b = 0; b < 256; ++b) {
      int mag = b & 0x7f;
      float x;
      if (mag < 8) {
        x = float(mag & 7) * 0x1p-9f;
      } else {
        uint32_t bits = (uint32_t(mag) << 20) + (120u << 23);
        std::memcpy(&x, &bits, 4);
      }
      v[b] = b >= 0x80 ? -x : x;
    }
  }
};
const Fp8Table kFp8;

inline void to_f32_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_f32_row(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef JAXINFER_AVX512_VNNI
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
#endif
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}
inline void to_f32_row(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))));
  for (; i < n; ++i) dst[i] = float(src[i]);
}
inline void to_f32_row(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_i32gather_ps(kFp8.v, idx, 4));
  }
  for (; i < n; ++i) dst[i] = kFp8.v[src[i]];
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Non-negative finite f32 lanes rounded to the nearest bf16 (ties to even), kept as f32.
inline __m256 round_bf16(__m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// Eight lanes' sums of eight vectors: lane i = the sum of h[i]'s lanes.
inline __m256 sums8(const __m256 h[8]) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));  // [0..3 low | 0..3 high]
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k_i for eight keys k_0..7 (rows of `k`, H apart): eight independent FMA chains, then their sums reduced
// together into one vector.
inline __m256 dot8(const float* q, const float* k, int64_t H) {
  __m256 d[8];
  for (int i = 0; i < 8; ++i) d[i] = _mm256_setzero_ps();
  for (int64_t h = 0; h < H; h += 8) {
    __m256 qv = _mm256_loadu_ps(q + h);
    for (int i = 0; i < 8; ++i) d[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * H + h), d[i]);
  }
  return sums8(d);
}

// out[0 : 8 NB] += sum_{i in [a, e)} p[i] v[i * H : ...]: NB independent accumulators in registers.
template <int NB>
inline void pv_block(const float* p, int64_t a, int64_t e, const float* v, int64_t H, float* out) {
  __m256 o[NB];
  for (int b = 0; b < NB; ++b) o[b] = _mm256_loadu_ps(out + 8 * b);
  for (int64_t i = a; i < e; ++i) {
    __m256 pv = _mm256_broadcast_ss(p + i);
    for (int b = 0; b < NB; ++b) o[b] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i * H + 8 * b), o[b]);
  }
  for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + 8 * b, o[b]);
}

#ifdef JAXINFER_AVX512_VNNI
// 512-bit: RG (<= 3) query rows that see the same keys (the GQA heads of one token) go through each key together,
// so a key is loaded once for all of them (the 256-bit code below loads it once per row), in 16-lane FMAs with
// masked tails (H a multiple of 8). Scores: 8 keys x RG rows of accumulators (24 of the 32 registers at RG = 3).
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

template <int RG>
void scores512(const float* q, const float* k, int64_t H, int64_t a, int64_t e, float* s) {
  int64_t i = a;
  for (; i + 8 <= e; i += 8) {
    __m512 d[RG][8];
    for (int r = 0; r < RG; ++r)
      for (int t = 0; t < 8; ++t) d[r][t] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h += 16) {
      const __mmask16 m = lanes(H - h);
      __m512 qv[RG];
      for (int r = 0; r < RG; ++r) qv[r] = _mm512_maskz_loadu_ps(m, q + r * H + h);
      for (int t = 0; t < 8; ++t) {
        __m512 kv = _mm512_maskz_loadu_ps(m, k + (i + t) * H + h);
        for (int r = 0; r < RG; ++r) d[r][t] = _mm512_fmadd_ps(qv[r], kv, d[r][t]);
      }
    }
    for (int r = 0; r < RG; ++r) {
      __m256 h8[8];
      for (int t = 0; t < 8; ++t)
        h8[t] = _mm256_add_ps(_mm512_castps512_ps256(d[r][t]), _mm512_extractf32x8_ps(d[r][t], 1));
      _mm256_storeu_ps(s + r * kTile + i, sums8(h8));
    }
  }
  for (; i < e; ++i)
    for (int r = 0; r < RG; ++r) {
      __m512 d = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += 16)
        d = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes(H - h), q + r * H + h),
                            _mm512_maskz_loadu_ps(lanes(H - h), k + i * H + h), d);
      s[r * kTile + i] = _mm512_reduce_add_ps(d);
    }
}

// The variant of a kernel for the next group of at most 3 rows, `left` rows remaining.
template <typename F>
inline F row_group(F one, F two, F three, int64_t left) { return left >= 3 ? three : left == 2 ? two : one; }

// out[r] += sum_{i in [a, e)} p[r][i] v[i] for RG rows, 64 outputs at a time (RG x 4 accumulators).
template <int RG>
void pv512(const float* p, int64_t a, int64_t e, const float* v, int64_t H, float* out) {
  for (int64_t h = 0; h < H; h += 64) {
    __mmask16 m[4];
    __m512 o[RG][4];
    for (int c = 0; c < 4; ++c) m[c] = H - h > 16 * c ? lanes(H - h - 16 * c) : __mmask16(0);
    for (int r = 0; r < RG; ++r)
      for (int c = 0; c < 4; ++c) o[r][c] = _mm512_maskz_loadu_ps(m[c], out + r * H + h + 16 * c);
    for (int64_t i = a; i < e; ++i) {
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = _mm512_maskz_loadu_ps(m[c], v + i * H + h + 16 * c);
      for (int r = 0; r < RG; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r * kTile + i]);
        for (int c = 0; c < 4; ++c) o[r][c] = _mm512_fmadd_ps(pr, vv[c], o[r][c]);
      }
    }
    for (int r = 0; r < RG; ++r)
      for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + r * H + h + 16 * c, m[c], o[r][c]);
  }
}
#endif

// The raw scores q_g . k_i of G query rows (`q` [G, H]) for the tile's keys [a, e) (`k` [n, H]) into
// s[g * kTile + i].
inline void tile_scores(const float* q, const float* k, int64_t H, int64_t G, int64_t a, int64_t e, float* s) {
#ifdef JAXINFER_AVX512_VNNI
  for (int64_t g = 0; g < G; g += 3)
    row_group(scores512<1>, scores512<2>, scores512<3>, G - g)(q + g * H, k, H, a, e, s + g * kTile);
#else
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = q + g * H;
    float* sr = s + g * kTile;
    int64_t i = a;
    for (; i + 8 <= e; i += 8) _mm256_storeu_ps(sr + i, dot8(qr, k + i * H, H));
    for (; i < e; ++i) {
      __m256 d = _mm256_setzero_ps();
      for (int64_t h = 0; h < H; h += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(qr + h), _mm256_loadu_ps(k + i * H + h), d);
      sr[i] = jaxinfer_gemv::hsum(d);
    }
  }
#endif
}

// acc[g] += sum_{i in [a, e)} p[g * kTile + i] v[i] for G rows (`acc` [G, H]).
inline void tile_values(const float* p, int64_t a, int64_t e, const float* v, int64_t H, int64_t G, float* acc) {
#ifdef JAXINFER_AVX512_VNNI
  for (int64_t g = 0; g < G; g += 3)
    row_group(pv512<1>, pv512<2>, pv512<3>, G - g)(p + g * kTile, a, e, v, H, acc + g * H);
#else
  for (int64_t g = 0; g < G; ++g) {
    float* out = acc + g * H;
    int64_t h = 0;
    for (; h + 64 <= H; h += 64) pv_block<8>(p + g * kTile, a, e, v + h, H, out + h);
    for (; h < H; h += 8) pv_block<1>(p + g * kTile, a, e, v + h, H, out + h);
  }
#endif
}

// ---------------------------------------------------------------------------------------------------------------
struct Problem {
  int64_t T, N, H, K, G, P, page_size, W;  // q rows, q heads, head dim, kv heads, q heads per kv head, pages, ...
  int64_t B, max_q_len, window;           // window 0: none
  float sm_scale, soft_cap;               // soft_cap 0: none
  bool bf16_probs;                        // probabilities rounded to bf16 before they weight the values
  const int32_t *kv_lens, *page_table, *cu_q_lens;
};

// The query rows of sequence b a call computes: tokens [cu_q_lens[b], +rows) (at most max_q_len, inside q).
struct SeqRows {
  int64_t first, rows, q_len, kv_len;
};

inline SeqRows seq_rows(const Problem& pr, int64_t b) {
  int64_t begin = std::clamp<int64_t>(pr.cu_q_lens[b], 0, pr.T);
  int64_t q_len = std::max<int64_t>(0, pr.cu_q_lens[b + 1] - pr.cu_q_lens[b]);
  int64_t rows = std::min({q_len, pr.max_q_len, pr.T - begin});
  int64_t kv_len = std::clamp<int64_t>(pr.kv_lens[b], 0, pr.W * pr.page_size);
  return {begin, rows, q_len, kv_len};
}

// Keys visible to token j of a sequence: positions [lo, hi) (causal, inside the context and the window).
inline void visible_range(const Problem& pr, const SeqRows& s, int64_t j, int64_t* lo, int64_t* hi) {
  int64_t pos = s.kv_len - s.q_len + j;
  *hi = std::min(pos + 1, s.kv_len);
  *lo = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
  if (*hi < *lo) *hi = *lo;
}

// Software prefetch of the keys and values at context positions [begin, end) of kv head kh: the pages of one
// head are page_size x H values apart from the next head's, a stride the hardware prefetchers do not follow far.
template <typename TP>
inline void prefetch(const Problem& pr, const int32_t* table, int64_t kh, const TP* k_pages, const TP* v_pages,
                     int64_t begin, int64_t end) {
  for (int64_t pos = begin; pos < end;) {
    const int64_t offset = pos % pr.page_size, n = std::min(pr.page_size - offset, end - pos);
    const int64_t page = std::clamp<int64_t>(table[pos / pr.page_size], 0, pr.P - 1);
    const int64_t first = ((page * pr.K + kh) * pr.page_size + offset) * pr.H;
    const char* kp = reinterpret_cast<const char*>(k_pages + first);
    const char* vp = reinterpret_cast<const char*>(v_pages + first);
    for (int64_t c = 0; c < n * pr.H * int64_t(sizeof(TP)); c += 64) {
      _mm_prefetch(kp + c, _MM_HINT_T0);
      _mm_prefetch(vp + c, _MM_HINT_T0);
    }
    pos += n;
  }
}

struct Item {
  int32_t b, kh;
  int64_t begin, end;  // context positions
};

// Per-thread scratch (reused across calls).
struct Scratch {
  std::vector<float> q, keys, values, scores;
  std::vector<float> key_scales = std::vector<float>(kTile), value_scales = std::vector<float>(kTile);
};

// The values of kv head kh at context positions [pos, pos + n) (n <= kTile; across pages) as f32 rows of `out`
// [n, H], and their scales (quantized pages) in `scales`.
template <typename TP>
inline void gather(const Problem& pr, const int32_t* table, int64_t kh, const TP* pages, const float* scale,
                   int64_t pos, int64_t n, float* out, float* scales) {
  for (int64_t end = pos + n; pos < end;) {
    const int64_t offset = pos % pr.page_size, count = std::min(pr.page_size - offset, end - pos);
    const int64_t page = std::clamp<int64_t>(table[pos / pr.page_size], 0, pr.P - 1);
    const int64_t token = (page * pr.K + kh) * pr.page_size + offset;
    to_f32_row(pages + token * pr.H, out, count * pr.H);
    if (scale) std::memcpy(scales, scale + token, count * sizeof(float));
    out += count * pr.H, scales += count, pos += count;
  }
}

// One work item: the rows (j, g) of sequence b's kv head kh over context positions [begin, end), into
// m [R], l [R], acc [R, H] (R = rows x G, row j * G + g); unnormalized (acc / l is the output).
template <typename TQ, typename TP>
void attend_span(const Problem& pr, const Item& it, const TQ* q, const TP* k_pages, const TP* v_pages,
                 const float* k_scale, const float* v_scale, float* m, float* l, float* acc) {
  const int64_t H = pr.H, G = pr.G;
  const SeqRows s = seq_rows(pr, it.b);
  const int64_t R = s.rows * G;
  thread_local Scratch sc;
  sc.q.resize(R * H);
  sc.keys.resize(kTile * H);
  sc.values.resize(kTile * H);
  sc.scores.resize(R * kTile);
  for (int64_t j = 0; j < s.rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const TQ* src = q + ((s.first + j) * pr.N + it.kh * G + g) * H;
      for (int64_t h = 0; h < H; ++h) sc.q[(j * G + g) * H + h] = to_f32(src[h]);
    }
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * H, 0.f);
  const int32_t* table = pr.page_table + int64_t(it.b) * pr.W;
  prefetch(pr, table, it.kh, k_pages, v_pages, it.begin, std::min(it.begin + kPrefetchTokens, it.end));
  for (int64_t pos = it.begin; pos < it.end;) {
    const int64_t n = std::min(it.end - pos, kTile);
    prefetch(pr, table, it.kh, k_pages, v_pages, pos + kPrefetchTokens, std::min(pos + kPrefetchTokens + n, it.end));
    gather(pr, table, it.kh, k_pages, k_scale, pos, n, sc.keys.data(), sc.key_scales.data());
    gather(pr, table, it.kh, v_pages, v_scale, pos, n, sc.values.data(), sc.value_scales.data());
    const float* kf = sc.keys.data();
    bool any = false;
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < s.rows; ++j) {
      int64_t lo, hi;
      visible_range(pr, s, j, &lo, &hi);
      const int64_t a = std::max(lo, pos) - pos, e = std::min(hi, pos + n) - pos;  // visible keys of the tile
      for (int64_t g = 0; g < G; ++g) {
        float* sr = sc.scores.data() + (j * G + g) * kTile;
        std::fill(sr, sr + n8, kNegInf);
      }
      if (a >= e) continue;
      any = true;
      // scores q . k for the G rows of token j, eight keys at a time (their sums reduced together)
      tile_scores(sc.q.data() + j * G * H, kf, H, G, a, e, sc.scores.data() + j * G * kTile);
      for (int64_t g = 0; g < G; ++g) {
        float* sr = sc.scores.data() + (j * G + g) * kTile;
        int64_t i;
        if (k_scale)
          for (i = a; i < e; ++i) sr[i] *= sc.key_scales[i];  // q . (k_int * k_scale)
        const __m256 scale = _mm256_set1_ps(pr.sm_scale);
        for (i = 0; i < n8; i += 8) _mm256_storeu_ps(sr + i, _mm256_mul_ps(_mm256_loadu_ps(sr + i), scale));
        if (pr.soft_cap > 0.f)
          for (i = a; i < e; ++i) sr[i] = pr.soft_cap * std::tanh(sr[i] / pr.soft_cap);
      }
      // online softmax: new max, rescale the row's sum and output, probabilities of the tile
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = j * G + g;
        float* sr = sc.scores.data() + r * kTile;
        __m256 mx8 = _mm256_set1_ps(m[r]);
        for (int64_t i = 0; i < n8; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sr + i));
        const float mx = hmax(mx8);
        const float alpha = m[r] == kNegInf ? 0.f : std::exp(m[r] - mx);
        m[r] = mx;
        __m256 mv = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
          __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), mv));  // masked keys (-inf) give 0
          sum = _mm256_add_ps(sum, p);
          _mm256_storeu_ps(sr + i, p);
        }
        l[r] = alpha * l[r] + jaxinfer_gemv::hsum(sum);
        if (v_scale)
          for (int64_t i = a; i < e; ++i) sr[i] *= sc.value_scales[i];  // sum_s p_s v_scale_s v_int_s
        if (pr.bf16_probs)
          for (int64_t i = 0; i < n8; i += 8) _mm256_storeu_ps(sr + i, round_bf16(_mm256_loadu_ps(sr + i)));
        if (alpha != 1.f)
          for (int64_t h = 0; h < H; ++h) acc[r * H + h] *= alpha;
      }
    }
    if (!any) {
      pos += n;
      continue;
    }
    const float* vf = sc.values.data();
    // acc += p @ v, 64 outputs of a row at a time in registers
    for (int64_t j = 0; j < s.rows; ++j) {
      int64_t lo, hi;
      visible_range(pr, s, j, &lo, &hi);
      const int64_t a = std::max(lo, pos) - pos, e = std::min(hi, pos + n) - pos;
      if (a >= e) continue;
      tile_values(sc.scores.data() + j * G * kTile, a, e, vf, H, G, acc + j * G * H);
    }
    pos += n;
  }
}

inline void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

template <typename TQ, typename TP>
void attention(const Problem& pr, const TQ* q, const TP* k_pages, const TP* v_pages, const float* k_scale,
               const float* v_scale, TQ* out) {
  const int64_t H = pr.H, G = pr.G;
  std::memset(static_cast<void*>(out), 0, pr.T * pr.N * H * sizeof(TQ));  // rows no sequence computes stay 0
  // Work items in (sequence, kv head, span) order; `first[b * K + kh]` indexes the first span of each.
  std::vector<Item> items;
  std::vector<int64_t> first(pr.B * pr.K + 1, 0), offset;
  for (int64_t b = 0; b < pr.B; ++b) {
    const SeqRows s = seq_rows(pr, b);
    int64_t lo = 0, hi = 0, unused;
    if (s.rows > 0) {
      visible_range(pr, s, 0, &lo, &unused);
      visible_range(pr, s, s.rows - 1, &unused, &hi);
    }
    for (int64_t kh = 0; kh < pr.K; ++kh) {
      first[b * pr.K + kh] = int64_t(items.size());
      for (int64_t begin = lo / kSplitTokens * kSplitTokens; begin < hi; begin += kSplitTokens)
        items.push_back({int32_t(b), int32_t(kh), std::max(lo, begin), std::min(hi, begin + kSplitTokens)});
    }
  }
  first[pr.B * pr.K] = int64_t(items.size());
  offset.resize(items.size() + 1, 0);  // each item's partials: m [R], l [R], acc [R, H]
  for (size_t i = 0; i < items.size(); ++i) offset[i + 1] = offset[i] + seq_rows(pr, items[i].b).rows * G * (H + 2);
  std::vector<float> partial(offset.back());
  parallel_chunks(int64_t(items.size()), [&](int64_t i) {
    const int64_t R = seq_rows(pr, items[i].b).rows * G;
    float* base = partial.data() + offset[i];
    attend_span(pr, items[i], q, k_pages, v_pages, k_scale, v_scale, base, base + R, base + 2 * R);
  });
  // combine each (sequence, kv head)'s spans in order: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i
  std::vector<float> row(H);
  for (int64_t b = 0; b < pr.B; ++b) {
    const SeqRows s = seq_rows(pr, b);
    const int64_t R = s.rows * G;
    for (int64_t kh = 0; kh < pr.K; ++kh)
      for (int64_t r = 0; r < R; ++r) {
        float mx = kNegInf, total = 0.f;
        for (int64_t i = first[b * pr.K + kh]; i < first[b * pr.K + kh + 1]; ++i)
          mx = std::max(mx, partial[offset[i] + r]);
        std::fill(row.begin(), row.end(), 0.f);
        if (mx != kNegInf) {
          for (int64_t i = first[b * pr.K + kh]; i < first[b * pr.K + kh + 1]; ++i) {
            const float* base = partial.data() + offset[i];
            if (base[r] == kNegInf) continue;
            const float w = std::exp(base[r] - mx);
            total += w * base[R + r];
            for (int64_t h = 0; h < H; ++h) row[h] += w * base[2 * R + r * H + h];
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          for (int64_t h = 0; h < H; ++h) row[h] *= inv;
        }
        const int64_t j = r / G, g = r % G;
        store(out + ((s.first + j) * pr.N + kh * G + g) * H, row.data(), H);
      }
  }
}

// ---------------------------------------------------------------------------------------------------------------
template <typename TQ>
ffi::Error dispatch_pages(const Problem& pr, const TQ* q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const float* ks, const float* vs, const ffi::Buffer<ffi::S32>& layer, TQ* out) {
  switch (k.element_type()) {
    case ffi::F32:
      attention(pr, q, at_layer<float>(k, layer), at_layer<float>(v, layer), nullptr, nullptr, out);
      break;
    case ffi::BF16:
      attention(pr, q, at_layer<uint16_t>(k, layer), at_layer<uint16_t>(v, layer), nullptr, nullptr, out);
      break;
    case ffi::S8:
      attention(pr, q, at_layer<int8_t>(k, layer), at_layer<int8_t>(v, layer), ks, vs, out);
      break;
    case ffi::U8:
    case ffi::F8E4M3FN:
      attention(pr, q, at_layer<uint8_t>(k, layer), at_layer<uint8_t>(v, layer), ks, vs, out);
      break;
    default:
      return ffi::Error::InvalidArgument("paged_attention: pages must be f32, bf16, int8, uint8 or f8e4m3fn");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::AnyBuffer q, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> cu_q_lens, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Result<ffi::AnyBuffer> out, int64_t max_q_len, float sm_scale,
                          int64_t sliding_window, float soft_cap) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || v_pages.dimensions().size() != 5 || page_table.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [T, N, H], pages [L, P, K, page_size, H], table [B, W]");
  if (kd[4] != qd[2] || qd[2] % 8 || qd[1] % kd[2] || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_attention: head dims differ or are not multiples of 8, or N % K");
  const bool quantized = k_pages.element_type() == ffi::S8 || k_pages.element_type() == ffi::U8 ||
                         k_pages.element_type() == ffi::F8E4M3FN;
  if (quantized && (k_scale.dimensions().size() != 4 || k_scale.element_count() * kd[4] != k_pages.element_count() ||
                    v_scale.element_count() != k_scale.element_count()))
    return ffi::Error::InvalidArgument("paged_attention: quantized pages need f32 scales [L, P, K, page_size]");
  Problem pr;
  pr.T = qd[0], pr.N = qd[1], pr.H = qd[2], pr.K = kd[2], pr.G = pr.N / pr.K, pr.P = kd[1], pr.page_size = kd[3];
  pr.B = page_table.dimensions()[0], pr.W = page_table.dimensions()[1];
  pr.max_q_len = max_q_len, pr.window = sliding_window, pr.sm_scale = sm_scale, pr.soft_cap = soft_cap;
  // as the reference: the probabilities take the values' dtype (quantized values: q's) before the value sum
  pr.bf16_probs = k_pages.element_type() == ffi::BF16 || (quantized && q.element_type() == ffi::BF16);
  pr.kv_lens = kv_lens.typed_data(), pr.page_table = page_table.typed_data(), pr.cu_q_lens = cu_q_lens.typed_data();
  const float* ks = quantized ? at_layer<float>(k_scale, layer) : nullptr;
  const float* vs = quantized ? at_layer<float>(v_scale, layer) : nullptr;
  if (q.element_type() == ffi::F32)
    return dispatch_pages(pr, reinterpret_cast<const float*>(q.untyped_data()), k_pages, v_pages, ks, vs, layer,
                          reinterpret_cast<float*>(out->untyped_data()));
  if (q.element_type() == ffi::BF16)
    return dispatch_pages(pr, reinterpret_cast<const uint16_t*>(q.untyped_data()), k_pages, v_pages, ks, vs, layer,
                          reinterpret_cast<uint16_t*>(out->untyped_data()));
  return ffi::Error::InvalidArgument("paged_attention: q must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_q_len")
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
