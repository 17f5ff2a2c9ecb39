// [NOTE] Routing kernel: router logits [T, E] -> topk_weights [T, k] fp32, topk_ids [T, k] int32.
//
// One token at a time, in fp32 whatever the logits dtype (docs/ROUTING.md has every formula):
//   1. load the row into fp32 (refusing NaN and +inf), note its max;
//   2. selection keys: the logits themselves, or `score + bias` when an
//      e_score_correction_bias is given (the scores are then needed for every expert);
//   3. grouped methods: a score per group (max key, or the sum of its two best keys with a
//      bias), keep the topk_group best groups;
//   4. top-k of the keys over the kept experts, in descending key order; equal keys: the lower
//      expert id wins (a strict total order, so the result is deterministic);
//   5. weights from the unbiased scores of the chosen experts (softmax, sigmoid, or DeepSeek-V4's
//      sqrt(softplus)); renormalize divides by
//      (sum + 1e-20); the routed_scaling_factor multiplies last.
// Keys are logits (not scores) when there is no bias: softmax and sigmoid are monotone, so this
// is the same top-k, except where fp32 scores saturate to equal values (sigmoid = 1.0 for
// logits above ~17, softmax probabilities that underflow to 0): there the larger logit wins
// instead of an arbitrary tie. It also spares an exp per expert for sigmoid.
//
// Compiled for the baseline target (no ISA flags): exp/sigmoid run 4 lanes wide through GCC/Clang
// vector extensions (SSE2 on x86-64, NEON on arm64), the rest is scalar O(E) work. A token costs
// ~1 us at E = 256 (DeepSeek-V3 grouped sigmoid), less than the torch dispatch of a call (~5 us),
// so wider ISAs would not show. Only calls with T * E >= kParallelWork go through the thread
// pool, so T = 1 never wakes a thread.
#include "moepack/routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "moepack/numeric.h"

namespace moepack {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kParallelWork = 1 << 15;  // T * E below this runs on the calling thread
constexpr int64_t kChunkWork = 1 << 14;     // T * E per parallel task
constexpr int64_t kInsertionMaxK = 32;      // insertion top-k up to this k, partial_sort above
constexpr float kRenormEps = 1e-20f;

// Per-thread scratch, grown on demand: no allocation per call once warm.
struct Scratch {
  std::vector<float> x;        // [E] logits in fp32
  std::vector<float> score;    // [E] scores
  std::vector<float> key;      // [E] selection keys (with a bias)
  std::vector<float> tmp;      // [k]
  std::vector<int64_t> lo, hi;  // [groups] kept expert ranges
  std::vector<float> gscore;   // [groups]
  std::vector<int32_t> order;  // [max(E, groups)] partial_sort workspace
  void fit(const RouteArgs& a) {
    const size_t E = size_t(a.experts), G = size_t(a.groups);
    if (x.size() < E) x.resize(E), score.resize(E), key.resize(E);
    if (tmp.size() < size_t(a.topk)) tmp.resize(size_t(a.topk));
    if (gscore.size() < G) lo.resize(G), hi.resize(G), gscore.resize(G);
    if (order.size() < std::max(E, G)) order.resize(std::max(E, G));
  }
};

Scratch& scratch_for(const RouteArgs& a) {
  thread_local Scratch s;
  s.fit(a);
  return s;
}

// ---- 4-wide exp (GCC/Clang vector extensions: SSE2 on the x86-64 baseline, NEON on arm64) ----
// Cephes expf: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), exp(r) by a degree-6
// polynomial, times 2^n built as 2^h * 2^(n-h) so that results down to the subnormals are right.
// Max error 1 ulp over the normal range (checked against libm); exp(x) = 0 below -104 and for
// -inf, +inf above 88.72. Branch-free, so -inf and huge magnitudes cost the same as anything.
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

inline v4f sel(v4i m, v4f a, v4f b) { return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }
inline v4f splat(float f) { return v4f{f, f, f, f}; }

inline v4f exp4(v4f x) {
  const v4i hi = x > splat(88.7228394f), lo = x < splat(-104.0f);
  x = sel(hi, splat(88.7228394f), x);
  x = sel(lo, splat(-104.0f), x);
  const v4f t = x * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23: rounds to nearest
  const v4f fn = t - 12582912.0f;
  const v4i n = (v4i)t - 0x4B400000;
  v4f r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  v4f p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  v4f y = p * r * r + r + 1.0f;
  const v4i h = n >> 1, l = n - h;
  y = y * (v4f)((h + 127) << 23) * (v4f)((l + 127) << 23);
  y = sel(hi, splat(kInf), y);
  return sel(lo, splat(0.0f), y);
}

inline v4f load4(const float* p, int64_t n) {  // n < 4: the rest is 0
  v4f v = {};
  std::memcpy(&v, p, size_t(n) * 4);
  return v;
}
inline void store4(float* p, v4f v, int64_t n) { std::memcpy(p, &v, size_t(n) * 4); }

// out[i] = exp(in[i] - shift); returns the sum of out.
float exp_row(const float* in, float shift, float* out, int64_t n) {
  v4f acc = {};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const v4f y = exp4(load4(in + i, 4) - shift);
    store4(out + i, y, 4);
    acc += y;
  }
  float sum = acc[0] + acc[1] + acc[2] + acc[3];
  if (i < n) {
    const v4f y = exp4(load4(in + i, n - i) - shift);
    store4(out + i, y, n - i);
    for (int64_t j = 0; j < n - i; ++j) sum += y[j];
  }
  return sum;
}

// out[i] = sigmoid(in[i]) = 1 / (1 + exp(-in[i])): 0 at -inf, 1 from ~17 up.
void sigmoid_row(const float* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(out + i, 1.0f / (1.0f + exp4(-load4(in + i, 4))), 4);
  if (i < n) store4(out + i, 1.0f / (1.0f + exp4(-load4(in + i, n - i))), n - i);
}

// out[i] = sqrt(softplus(in[i])), softplus as torch's (beta 1, threshold 20: the value itself
// above 20, else log1p(exp(x))): 0 at -inf. DeepSeek-V4's router score (scalar libm: E <= 384).
void sqrtsoftplus_row(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = in[i];
    out[i] = std::sqrt(x > 20.0f ? x : std::log1p(std::exp(x)));
  }
}

// a ranks before b: larger key, then lower id.
inline bool ranks_before(float ka, int32_t ia, float kb, int32_t ib) { return ka > kb || (ka == kb && ia < ib); }

// Top-k of key[e] over the experts e in [lo[r], hi[r]) for r < nr, in descending rank order, into
// ids[0..k) (vals[0..k) get the keys). Ranges are ascending and experts are visited in ascending
// id order, so the strict `>` of the insertion keeps the lower id on equal keys.
void topk_keys(const float* key, const int64_t* lo, const int64_t* hi, int64_t nr, int64_t k, int32_t* ids,
               float* vals, std::vector<int32_t>& order) {
  if (k <= kInsertionMaxK) {
    int64_t have = 0;
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t e = lo[r]; e < hi[r]; ++e) {
        const float v = key[e];
        if (have == k && !(v > vals[k - 1])) continue;
        int64_t j = have < k ? have++ : k - 1;
        while (j > 0 && v > vals[j - 1]) {
          vals[j] = vals[j - 1];
          ids[j] = ids[j - 1];
          --j;
        }
        vals[j] = v;
        ids[j] = int32_t(e);
      }
    }
    return;
  }
  int64_t m = 0;
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t e = lo[r]; e < hi[r]; ++e) order[m++] = int32_t(e);
  std::partial_sort(order.begin(), order.begin() + k, order.begin() + m,
                    [&](int32_t a, int32_t b) { return ranks_before(key[a], a, key[b], b); });
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = order[j];
    vals[j] = key[order[j]];
  }
}

// Loads row t into x (fp32). Returns the index of the first NaN / +inf logit, or -1; *mx = max.
int64_t load_row(const RouteArgs& a, int64_t t, float* x, float* mx) {
  const int64_t E = a.experts;
  switch (a.logits_dtype) {
    case DType::f32: std::memcpy(x, static_cast<const float*>(a.logits) + t * a.logits_stride, E * 4); break;
    case DType::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(a.logits) + t * a.logits_stride;
      for (int64_t e = 0; e < E; ++e) x[e] = bf16_to_f32(p[e]);
      break;
    }
    case DType::f16: {
      const uint16_t* p = static_cast<const uint16_t*>(a.logits) + t * a.logits_stride;
      for (int64_t e = 0; e < E; ++e) x[e] = f16_to_f32(p[e]);
      break;
    }
  }
  // max and "any NaN or +inf" (!(x < inf)), 4 lanes at a time; padding lanes are -inf
  v4f m4 = splat(-kInf);
  v4i bad4 = {};
  int64_t e = 0;
  for (; e + 4 <= E; e += 4) {
    const v4f v = load4(x + e, 4);
    bad4 |= ~(v < splat(kInf));
    m4 = sel(v > m4, v, m4);
  }
  float m = m4[0];
  for (int j = 1; j < 4; ++j) m = m4[j] > m ? m4[j] : m;
  for (; e < E; ++e) {
    bad4[0] |= !(x[e] < kInf);
    m = x[e] > m ? x[e] : m;
  }
  *mx = m;
  if ((bad4[0] | bad4[1] | bad4[2] | bad4[3]) == 0) return -1;
  for (e = 0; e < E; ++e)
    if (!(x[e] < kInf)) return e;
  return -1;
}

inline float exp1(float x) { return exp4(splat(x))[0]; }

// softmax over the whole row into score[]; all -inf -> all 0 (no NaN).
void softmax_row(const float* x, int64_t E, float mx, float* score) {
  if (mx == -kInf) {
    std::fill(score, score + E, 0.0f);
    return;
  }
  const float inv = 1.0f / exp_row(x, mx, score, E);
  for (int64_t e = 0; e < E; ++e) score[e] *= inv;
}

void finish_weights(const RouteArgs& a, float* w) {
  const int64_t k = a.topk;
  if (a.renormalize) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j];
    const float den = sum + kRenormEps;
    for (int64_t j = 0; j < k; ++j) w[j] /= den;
  }
  if (a.scale != 1.0f)
    for (int64_t j = 0; j < k; ++j) w[j] *= a.scale;
}

// Phi-3.5-MoE sparsemixer, inference branch (transformers phimoe `sparsemixer`, training=False).
void route_sparsemixer(const RouteArgs& a, const float* x, float* w, int32_t* ids) {
  const int64_t E = a.experts;
  const float thr = float(2.0 * double(a.sparsemixer_eps));
  int32_t first = -1;
  for (int round = 0; round < 2; ++round) {
    // the max (lowest id on ties) over the experts not yet chosen
    float m = -kInf;
    int32_t arg = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (e == first) continue;
      if (arg < 0 || x[e] > m) {
        m = x[e];
        arg = int32_t(e);
      }
    }
    float weight = 0.0f;
    if (m != -kInf) {
      // softmax over the logits that survive (m - s) / max(|s|, m) > 2 eps, taken at the max
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        if (e == first) continue;
        const float factor = std::max(std::fabs(x[e]), m);
        if ((m - x[e]) / factor > thr) continue;
        sum += exp1(x[e] - m);
      }
      weight = 1.0f / sum;
    }
    ids[round] = arg;
    w[round] = weight;
    first = arg;
  }
  finish_weights(a, w);
}

void route_one(const RouteArgs& a, Scratch& s, const float* x, float mx, float* w, int32_t* ids) {
  const int64_t E = a.experts, k = a.topk;
  const RouteMethod m = a.method;
  if (m == RouteMethod::sparsemixer) return route_sparsemixer(a, x, w, ids);
  const bool soft = m == RouteMethod::softmax || m == RouteMethod::grouped_softmax;
  float* score = s.score.data();
  const float* key = x;
  if (a.bias && m == RouteMethod::biased_logit_sigmoid) {  // the bias on the logits, not on the scores
    float* kb = s.key.data();
    for (int64_t e = 0; e < E; ++e) kb[e] = x[e] + a.bias[e];
    key = kb;
  } else if (a.bias) {
    if (soft) softmax_row(x, E, mx, score);
    else if (m == RouteMethod::sqrtsoftplus) sqrtsoftplus_row(x, score, E);
    else sigmoid_row(x, score, E);
    float* kb = s.key.data();
    for (int64_t e = 0; e < E; ++e) kb[e] = score[e] + a.bias[e];
    key = kb;
  }
  float* vals = w;  // the keys of the chosen experts land in w first
  if (a.groups > 1) {
    const int64_t G = a.groups, per = E / G;
    float* gs = s.gscore.data();
    for (int64_t g = 0; g < G; ++g) {
      const float* kg = key + g * per;
      if (a.bias) {  // sum of the two best keys of the group (the one key if the group has one)
        float b1 = -kInf, b2 = -kInf;
        for (int64_t i = 0; i < per; ++i) {
          const float v = kg[i];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
        gs[g] = per >= 2 ? b1 + b2 : b1;
      } else {
        float b1 = -kInf;
        for (int64_t i = 0; i < per; ++i) b1 = kg[i] > b1 ? kg[i] : b1;
        gs[g] = b1;
      }
    }
    // topk_group best groups (lower group id on ties), as a keep mask
    std::vector<int32_t>& order = s.order;
    for (int64_t g = 0; g < G; ++g) order[g] = int32_t(g);
    std::partial_sort(order.begin(), order.begin() + a.topk_group, order.begin() + G,
                      [&](int32_t p, int32_t q) { return ranks_before(gs[p], p, gs[q], q); });
    // the kept groups as expert ranges, in ascending order
    std::sort(order.begin(), order.begin() + a.topk_group);
    int64_t* lo = s.lo.data();
    int64_t* hi = s.hi.data();
    for (int64_t j = 0; j < a.topk_group; ++j) {
      lo[j] = order[j] * per;
      hi[j] = lo[j] + per;
    }
    topk_keys(key, lo, hi, a.topk_group, k, ids, vals, s.order);
  } else {
    const int64_t lo = 0, hi = E;
    topk_keys(key, &lo, &hi, 1, k, ids, vals, s.order);
  }

  switch (m) {
    case RouteMethod::softmax:
    case RouteMethod::grouped_softmax:
      if (a.bias) {
        for (int64_t j = 0; j < k; ++j) w[j] = score[ids[j]];
      } else if (mx == -kInf) {
        std::fill(w, w + k, 0.0f);
      } else {
        const float inv = 1.0f / exp_row(x, mx, score, E);
        for (int64_t j = 0; j < k; ++j) w[j] = score[ids[j]] * inv;
      }
      break;
    case RouteMethod::sigmoid:
    case RouteMethod::grouped_sigmoid:
    case RouteMethod::llama4:
    case RouteMethod::sqrtsoftplus:
    case RouteMethod::biased_logit_sigmoid:
      if (a.bias && m != RouteMethod::biased_logit_sigmoid)
        for (int64_t j = 0; j < k; ++j) w[j] = score[ids[j]];
      else {  // the chosen logits' scores, by the method's scoring function
        float* t = s.tmp.data();
        for (int64_t j = 0; j < k; ++j) t[j] = x[ids[j]];
        (m == RouteMethod::sqrtsoftplus ? sqrtsoftplus_row : sigmoid_row)(t, w, k);
      }
      break;
    case RouteMethod::topk_softmax: {
      const float top = x[ids[0]];  // the largest chosen logit
      if (top == -kInf) {
        std::fill(w, w + k, 0.0f);
        break;
      }
      float* t = s.tmp.data();
      for (int64_t j = 0; j < k; ++j) t[j] = x[ids[j]];
      const float inv = 1.0f / exp_row(t, top, w, k);
      for (int64_t j = 0; j < k; ++j) w[j] *= inv;
      break;
    }
    case RouteMethod::sparsemixer: break;
  }
  finish_weights(a, w);
}

struct Shared {
  const RouteArgs* a;
  int64_t chunk;
  std::mutex mu;
  RouteError err;
};

void record(Shared& sh, const RouteError& e) {
  std::lock_guard<std::mutex> lock(sh.mu);
  if (sh.err.token < 0 || e.token < sh.err.token) sh.err = e;
}

RouteError route_range(const RouteArgs& a, int64_t t0, int64_t t1) {
  Scratch& s = scratch_for(a);
  for (int64_t t = t0; t < t1; ++t) {
    float mx;
    const int64_t bad = load_row(a, t, s.x.data(), &mx);
    if (bad >= 0) return RouteError{t, bad, s.x[bad]};
    route_one(a, s, s.x.data(), mx, a.weights + t * a.topk, a.ids + t * a.topk);
  }
  return RouteError{};
}

void chunk_body(void* ctx, int64_t begin, int64_t end) {
  Shared& sh = *static_cast<Shared*>(ctx);
  const RouteArgs& a = *sh.a;
  for (int64_t c = begin; c < end; ++c) {
    const int64_t t0 = c * sh.chunk, t1 = std::min(a.tokens, t0 + sh.chunk);
    RouteError e = route_range(a, t0, t1);
    if (e.token >= 0) {
      record(sh, e);
      return;
    }
  }
}

}  // namespace

const char* route_method_name(RouteMethod m) {
  switch (m) {
    case RouteMethod::softmax: return "softmax";
    case RouteMethod::sigmoid: return "sigmoid";
    case RouteMethod::grouped_softmax: return "grouped_softmax";
    case RouteMethod::grouped_sigmoid: return "grouped_sigmoid";
    case RouteMethod::topk_softmax: return "topk_softmax";
    case RouteMethod::llama4: return "llama4";
    case RouteMethod::sparsemixer: return "sparsemixer";
    case RouteMethod::sqrtsoftplus: return "sqrtsoftplus";
    case RouteMethod::biased_logit_sigmoid: return "biased_logit_sigmoid";
  }
  return "?";
}

bool route_method_parse(const char* name, RouteMethod* out) {
  for (int i = 0; i < kNumRouteMethods; ++i) {
    if (std::strcmp(name, route_method_name(RouteMethod(i))) == 0) {
      *out = RouteMethod(i);
      return true;
    }
  }
  return false;
}

RouteError route_tokens(const RouteArgs& a) {
  if (a.tokens <= 0) return RouteError{};
  const int64_t work = a.tokens * a.experts;
  if (work < kParallelWork || a.par.run == nullptr || a.par.num_threads <= 1) return route_range(a, 0, a.tokens);
  Shared sh;
  sh.a = &a;
  sh.chunk = std::max<int64_t>(1, kChunkWork / a.experts);
  const int64_t nchunks = (a.tokens + sh.chunk - 1) / sh.chunk;
  a.par.run(a.par.self, nchunks, chunk_body, &sh);
  return sh.err;
}

}  // namespace moepack
