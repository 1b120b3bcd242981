// Row summaries of a decode step's logits on x86 CPUs (AVX2 + FMA), called from jitted JAX code through XLA's
// FFI: per row of f32 logits [B, V], the first index of the largest logit among the allowed tokens (greedy
// sampling: ids below vocab_limit, not suppressed, their bit set in the row's token bitmask), and the raw row's
// max and log-sum-exp over [0, vocab_limit) (the sampled token's log-probability), and whether every logit of the
// row is finite. XLA:CPU runs these row reductions one element at a time (~2-5 ns an element: 0.1-0.25 ms a row of
// SmolLM2's 49,152 logits each, a tenth of a quantized decode step); here they run in vectors, over both cores.
// Semantics: jaxinfer/engine/sampling.py (`jnp.argmax` of the banned logits, `sampling_math.token_logprobs`); the
// Python wrapper is pallas_kernels/cpu_gemv/logits.py. Below, a second kernel: the top-k / top-p threshold.
//
// Work split: one item per (row, span of kSpan logits); spans sit at fixed offsets and are combined in span order,
// so results do not depend on the number of threads. Each span's sum of exponentials is taken against the span's
// own max and rescaled to the row's (the sums of the jnp reference run in another order: log-sum-exps agree to
// f32 rounding). The argmax is exact: the first index of the largest value, a NaN counting as the largest (as
// `jnp.argmax`), index 0 when every token is banned.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"
#include "threads.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer_gemv::exp8;
using jaxinfer_gemv::hsum;
using jaxinfer_gemv::parallel_chunks;

#if !defined(__AVX2__) || !defined(__FMA__)
#error "logits.cc needs AVX2 and FMA (build.py passes -mavx2 -mfma)"
#endif

constexpr int64_t kSpan = 8192;  // logits per work item (a multiple of 32: whole bitmask words)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Span {
  float best = kNegInf;    // the largest allowed logit (NaN once an allowed NaN is seen)
  int64_t best_at = -1;    // its first index; -1: no allowed logit above -inf
  float max = kNegInf;     // the raw max over the span's ids below the vocab limit (NaN if one is NaN)
  float sum = 0.f;         // sum of exp(x - max) over those ids (0 when max is -inf)
  bool finite = true;      // no NaN or inf in the whole span (ids past the limit included)
};

// Whether x[lo, hi) holds no NaN or inf.
inline bool all_finite(const float* x, int64_t lo, int64_t hi) {
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8)
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), big, _CMP_LE_OQ));
  bool finite = _mm256_movemask_ps(ok) == 0xff;
  for (; i < hi; ++i) finite = finite && std::isfinite(x[i]);
  return finite;
}

// 8 lanes' masks from 8 bits: lane i true iff bit i of `bits` is set.
inline __m256 bit_lanes(uint32_t bits) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i b = _mm256_and_si256(_mm256_set1_epi32(int(bits)), select);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, select));
}

// Logits [lo, hi) of one row. `allowed`: the row's bitmask with the suppressed ids cleared (bit t % 32 of word
// t / 32); ids >= `limit` are neither allowed nor counted.
Span summarize(const float* x, const uint32_t* allowed, int64_t lo, int64_t hi, int64_t limit) {
  Span s;
  const int64_t end = std::max(lo, std::min(hi, limit));
  s.finite = all_finite(x, end, hi);
  if (end == lo) return s;
  // Pass 1: per lane, the raw max and the allowed max with its first index (strict >: earlier indices win ties).
  __m256 raw = _mm256_set1_ps(kNegInf), best = _mm256_set1_ps(kNegInf), nan = _mm256_setzero_ps();
  __m256 low = _mm256_set1_ps(-kNegInf);
  __m256i at = _mm256_set1_epi32(-1), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  index = _mm256_add_epi32(index, _mm256_set1_epi32(int32_t(lo)));
  int64_t i = lo;
  for (; i + 8 <= end; i += 8, index = _mm256_add_epi32(index, eight)) {
    __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    low = _mm256_min_ps(low, v);
    raw = _mm256_max_ps(raw, v);
    __m256 a = _mm256_blendv_ps(neg_inf, v, bit_lanes(allowed[i >> 5] >> (i & 31)));
    __m256 gt = _mm256_cmp_ps(a, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, a, gt);
    at = _mm256_blendv_epi8(at, index, _mm256_castps_si256(gt));
  }
  alignas(32) float lanes[8], best_lanes[8], low_lanes[8];
  alignas(32) int32_t at_lanes[8];
  _mm256_store_ps(lanes, raw), _mm256_store_ps(best_lanes, best), _mm256_store_ps(low_lanes, low);
  _mm256_store_si256(reinterpret_cast<__m256i*>(at_lanes), at);
  bool has_nan = _mm256_movemask_ps(nan) != 0, has_inf = false;
  for (int l = 0; l < 8; ++l) {
    s.max = std::max(s.max, lanes[l]);
    if (end - lo >= 8)  // the lanes saw logits: +inf is the max, -inf the min
      has_inf = has_inf || std::isinf(lanes[l]) || std::isinf(low_lanes[l]);
    if (at_lanes[l] >= 0 && (best_lanes[l] > s.best || (best_lanes[l] == s.best && at_lanes[l] < s.best_at)))
      s.best = best_lanes[l], s.best_at = at_lanes[l];
  }
  for (; i < end; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    has_inf = has_inf || std::isinf(x[i]);
    s.max = std::max(s.max, x[i]);
    if ((allowed[i >> 5] >> (i & 31)) & 1 && x[i] > s.best) s.best = x[i], s.best_at = i;
  }
  s.finite = s.finite && !has_nan && !has_inf;
  if (has_nan) {  // NaN: the raw max and sum are NaN; an allowed NaN is the argmax (its first index)
    s.max = s.sum = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = lo; j < end; ++j)
      if (std::isnan(x[j]) && ((allowed[j >> 5] >> (j & 31)) & 1)) {
        s.best = x[j], s.best_at = j;
        break;
      }
    return s;
  }
  if (s.max == kNegInf) return s;
  // Pass 2: the sum of exp(x - max) over the span (the row is in L2 after pass 1).
  const __m256 m = _mm256_set1_ps(s.max);
  __m256 acc = _mm256_setzero_ps();
  for (i = lo; i + 8 <= end; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
  s.sum = hsum(acc);
  for (; i < end; ++i) s.sum += std::exp(x[i] - s.max);
  return s;
}

// logits f32 [B, V], suppress i32 [B, S] (ids in [0, V), -1 pads), bitmask i32 [B, ceil(V / 32)], vocab_limit
// i32 [] -> argmax i32 [B] (allowed ids), max f32 [B], log_sum_exp f32 [B] (of exp(x - max) over [0, limit)) and
// finite bool [B] (no NaN or inf in the row).
ffi::Error LogitRows(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> suppress, ffi::Buffer<ffi::S32> bitmask,
                     ffi::Buffer<ffi::S32> vocab_limit, ffi::Result<ffi::Buffer<ffi::S32>> argmax,
                     ffi::Result<ffi::Buffer<ffi::F32>> row_max, ffi::Result<ffi::Buffer<ffi::F32>> log_sum_exp,
                     ffi::Result<ffi::Buffer<ffi::PRED>> finite) {
  if (logits.dimensions().size() != 2 || suppress.dimensions().size() != 2 || bitmask.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("logit_rows: logits, suppress and bitmask must be 2-d");
  const int64_t B = logits.dimensions()[0], V = logits.dimensions()[1], S = suppress.dimensions()[1];
  const int64_t W = (V + 31) / 32;
  if (suppress.dimensions()[0] != B || bitmask.dimensions()[0] != B || bitmask.dimensions()[1] != W)
    return ffi::Error::InvalidArgument("logit_rows: suppress must be [B, S] and bitmask [B, ceil(V / 32)]");
  const int64_t limit = std::min<int64_t>(V, std::max<int64_t>(0, vocab_limit.typed_data()[0]));
  // Each row's allowed bits: its bitmask less its suppressed ids, as words (ids past V stay unset).
  std::vector<uint32_t> allowed(B * W);  // spans start at multiples of 32: 8 lanes' bits lie in one word
  for (int64_t b = 0; b < B; ++b) {
    uint32_t* row = allowed.data() + b * W;
    const int32_t* words = bitmask.typed_data() + b * W;
    for (int64_t w = 0; w < W; ++w) row[w] = uint32_t(words[w]);
    for (int64_t j = 0; j < S; ++j) {
      int32_t id = suppress.typed_data()[b * S + j];
      if (id >= 0 && id < V) row[id >> 5] &= ~(1u << (id & 31));
    }
  }
  const int64_t spans = std::max<int64_t>(1, (V + kSpan - 1) / kSpan);
  std::vector<Span> parts(B * spans);
  parallel_chunks(B * spans, [&](int64_t item) {
    const int64_t b = item / spans, lo = (item % spans) * kSpan;
    parts[item] = summarize(logits.typed_data() + b * V, allowed.data() + b * W, lo, std::min(V, lo + kSpan),
                            limit);
  });
  for (int64_t b = 0; b < B; ++b) {
    const Span* p = parts.data() + b * spans;
    float best = kNegInf, top = kNegInf;
    int64_t best_at = -1;
    bool nan = false, all = true;
    for (int64_t j = 0; j < spans; ++j) all = all && p[j].finite;
    finite->typed_data()[b] = all;
    for (int64_t j = 0; j < spans; ++j) {
      if (p[j].best_at >= 0 && best_at >= 0 && std::isnan(best)) continue;  // an earlier NaN stays the argmax
      if (p[j].best_at >= 0 && (best_at < 0 || std::isnan(p[j].best) || p[j].best > best))
        best = p[j].best, best_at = p[j].best_at;
    }
    for (int64_t j = 0; j < spans; ++j) nan = nan || std::isnan(p[j].max), top = std::max(top, p[j].max);
    float total = 0.f;
    for (int64_t j = 0; j < spans; ++j)
      if (p[j].max != kNegInf) total += p[j].sum * std::exp(p[j].max - top);
    argmax->typed_data()[b] = int32_t(best_at < 0 ? 0 : best_at);
    // jnp's arithmetic gives NaN for a NaN below the limit, a +inf there (exp(inf - inf)) or every logit -inf
    bool undefined = nan || std::isinf(top);
    row_max->typed_data()[b] = undefined ? std::numeric_limits<float>::quiet_NaN() : top;
    log_sum_exp->typed_data()[b] = undefined ? std::numeric_limits<float>::quiet_NaN() : std::log(total);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Top-k / top-p: the threshold below which a row of temperature-scaled logits is dropped, as
// jaxinfer/engine/sampling.py's `_truncate` computes it by sorting the row (kth = the k-th largest value; the
// softmax of the top-k set; the kept prefix of the descending order whose mass before each token is < top_p, the
// first token always; threshold = max(kth, the smallest kept value)), without sorting the row: a floor below the
// max is lowered (1, 2, 4, ... 64, then none) until the logits above it number k (top-k) or hold top_p of the
// top-k set's mass (top-p), and only those are selected or sorted. NaNs count as below every value (the sort puts
// them last). The softmax's sum and the kept prefix's mass are summed in f64 (the sort path sums in f32, in
// another order): a token whose mass-before lies within ~1e-6 of top_p can land on the other side.
constexpr float kWindows[] = {1.f, 2.f, 4.f, 8.f, 16.f, 32.f, 64.f, std::numeric_limits<float>::infinity()};

// How many of x [V] are >= floor, and the sum of e over them (e: nullptr for no sum).
std::pair<int64_t, float> at_least(const float* x, const float* e, int64_t V, float floor) {
  const __m256 f8 = _mm256_set1_ps(floor);
  __m256 sum = _mm256_setzero_ps();
  int64_t count = 0, i = 0;
  for (; i + 8 <= V; i += 8) {
    __m256 ge = _mm256_cmp_ps(_mm256_loadu_ps(x + i), f8, _CMP_GE_OQ);
    count += __builtin_popcount(_mm256_movemask_ps(ge));
    if (e) sum = _mm256_add_ps(sum, _mm256_and_ps(ge, _mm256_loadu_ps(e + i)));
  }
  float total = e ? hsum(sum) : 0.f;
  for (; i < V; ++i)
    if (x[i] >= floor) ++count, total += e ? e[i] : 0.f;
  return {count, total};
}

void collect(const float* x, int64_t V, float floor, std::vector<float>& out) {
  out.clear();
  for (int64_t i = 0; i < V; ++i)
    if (x[i] >= floor) out.push_back(x[i]);  // false for NaN
}

float truncation_threshold(const float* x, int64_t V, int64_t k, float p, std::vector<float>& buf,
                           std::vector<float>& e) {
  float top = kNegInf;
  for (int64_t i = 0; i < V; ++i) top = std::max(top, x[i]);  // std::max(a, NaN) keeps a
  if (top == kNegInf) return kNegInf;  // every logit -inf (or NaN): nothing to drop
  float kth = kNegInf;
  if (k < V) {  // the k-th largest non-NaN value, among the fewest logits near the max that hold k of them
    kth = std::numeric_limits<float>::quiet_NaN();  // fewer than k non-NaN values
    for (float window : kWindows)
      if (at_least(x, nullptr, V, top - window).first >= k) {
        collect(x, V, top - window, buf);
        std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
        kth = buf[k - 1];
        break;
      }
    if (std::isnan(kth)) return kth;
  }
  if (p >= 1.f) return kth;
  // the top-k set's softmax numerators exp(x - top) (0 elsewhere) and their sum, in vectors
  e.resize(V);
  const __m256 t8 = _mm256_set1_ps(top), k8 = _mm256_set1_ps(kth);
  __m256d acc = _mm256_setzero_pd();  // sums in f64: a top-p prefix can hold tens of thousands of terms
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 ev = _mm256_and_ps(_mm256_cmp_ps(v, k8, _CMP_GE_OQ), exp8(_mm256_sub_ps(v, t8)));
    _mm256_storeu_ps(e.data() + i, ev);
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(ev)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1))));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  double z = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < V; ++i) z += (e[i] = x[i] >= kth ? std::exp(x[i] - top) : 0.f);
  for (float window : kWindows) {
    const float floor = std::max(kth, top - window);
    if (floor > kth && at_least(x, e.data(), V, floor).second < p * z) continue;  // too little mass above it
    collect(x, V, floor, buf);
    std::sort(buf.begin(), buf.end(), std::greater<float>());
    double before = 0.;
    float cutoff = buf[0];
    size_t j = 0;
    for (; j < buf.size() && (j == 0 || before < p); ++j) cutoff = buf[j], before += std::exp(buf[j] - top) / z;
    if (j < buf.size() || before >= p || floor == kth) return std::max(kth, cutoff);  // the prefix ended inside
  }
  return kth;  // not reached: the last window holds the whole top-k set
}

// scaled f32 [B, V], top_k i32 [B] (in [1, V]; V: off), top_p f32 [B] -> threshold f32 [B].
ffi::Error TruncationThreshold(ffi::Buffer<ffi::F32> scaled, ffi::Buffer<ffi::S32> top_k,
                               ffi::Buffer<ffi::F32> top_p, ffi::Result<ffi::Buffer<ffi::F32>> threshold) {
  if (scaled.dimensions().size() != 2 || top_k.element_count() != scaled.dimensions()[0] ||
      top_p.element_count() != scaled.dimensions()[0])
    return ffi::Error::InvalidArgument("truncation_threshold: scaled [B, V], top_k [B] and top_p [B]");
  const int64_t B = scaled.dimensions()[0], V = scaled.dimensions()[1];
  parallel_chunks(B, [&](int64_t b) {
    thread_local std::vector<float> buf, e;
    const int64_t k = std::clamp<int64_t>(top_k.typed_data()[b], 1, V);
    threshold->typed_data()[b] = truncation_threshold(scaled.typed_data() + b * V, V, k, top_p.typed_data()[b], buf, e);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_logit_rows, LogitRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_truncation_threshold, TruncationThreshold,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
