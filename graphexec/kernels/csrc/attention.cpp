// Paged attention on CPU for graphexec::attention and graphexec::paged_attention (schemas are
// defined in Python: graphexec/attention/op.py; the backend that uses them: graphexec/attention/cpu.py).
//
// The KV pool is one tensor per side, [layers, slots, kv_heads, head_dim] (fp32, bf16 or fp16),
// read in place through the request -> token table: keys are never gathered into new tensors.
// Each call first writes this step's k/v rows into the pool at out_cache_loc (real tokens only;
// padded rows write nothing and get zero output), then attends:
//
//   decode   one query token per row against the row's seq_len keys (the last `window` of them
//            under a sliding window), all heads at once (a slot's K and V rows are read whole, in
//            order, prefetched ahead).  Tasks are rows; a long context with few rows is cut into
//            key splits across threads and the partial softmaxes combined.
//   extend   per request, a run of q_len query tokens at positions prefix..prefix+q_len-1 against
//            keys 0..position (causal, cached prefix included; position - window + 1..position
//            under a sliding window).  Runs of a few tokens are served like decode rows; longer
//            runs go through a blocked flash-attention loop: the request's keys are packed once
//            into fp32 blocks (K transposed), then each task (request, kv head, tile of query
//            tokens) streams the key blocks from its window's start (0 with no window) up to its
//            causal limit with an online softmax, scores and outputs computed by register-blocked
//            AVX-512 kernels.
//
// The sliding window (Mistral's, transformers' semantics: a query at position p sees keys
// p - window + 1 .. p) is an argument: 0 or less is full attention.  Keys below it stay in the
// pool (no eviction); they are skipped, never read.  It may differ per layer (Gemma alternates
// windowed and full layers): the binding holds every layer's and the call picks its layer's.
//
// Softmax runs in fp32 in base 2 (q is pre-scaled by scale * log2(e); scale is head_dim^-0.5
// unless the caller gives one, Gemma's query_pre_attn_scalar^-0.5); activations and the pool
// may each be fp32, bf16 or fp16; every product is accumulated in fp32.  With a logit soft-cap
// (Gemma 2) each score s becomes cap * tanh(s / cap) before the running max and exponentials, in
// the same base-2 units (the cap times log2(e)); without one the score path is unchanged (one
// test per block of scores, never per score).
//
// The C++ route of graphexec::attention reads the pool and metadata from a per-thread binding set
// once per forward (attention_bind); with no binding it redispatches to graphexec::attention_py,
// the Python route (other backends, other devices).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// 256-bit paths for AVX2 builds without AVX-512 (the softmax's exponentials and the decode dots):
// with only the scalar loops, a 1024-token prompt's attention took 5.5x the AVX-512 time and 3x
// the plain-torch path's on such a machine (`GRAPHEXEC_KERNEL_ISA=avx2 graphexec-bench attention_kernels`).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define GX_ATTN_AVX2 1
#endif

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------------
// Element conversion

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // bf16/fp16: round to nearest even, as Tensor.to does
}

// dst[i] = src[i] * scale (fp32)
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

template <typename S, typename D>
inline void convert_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]));
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 2^x for x <= 0 (softmax arguments): round-to-nearest split, degree-7 Taylor polynomial on
// [-0.5, 0.5] (relative error ~1e-8), scaled by 2^n.  Arguments below -126 give ~0 (not NaN).
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(GX_ATTN_AVX2)
// exp2_16's polynomial on 8 lanes; 2^n by building the exponent (n >= -126: a normal float).
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

inline float exp2_scalar(float x) { return std::exp2(std::max(x, -126.0f)); }

// Logit soft-capping of n scores in place: s = cap * tanh(s / cap) (cap > 0, in the scores'
// base-2 units).  Vectorized through the softmax's exp2: tanh(y) = sign(y) (1 - e) / (1 + e)
// with e = e^(-2|y|) = 2^(-2 |y| log2(e)) in (0, 1], so nothing overflows; absolute error a few
// 1e-8 of the cap.  The tail (and the portable build) take std::tanh.
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), vcap = _mm512_set1_ps(cap), k = _mm512_set1_ps(-2.0f * kLog2e);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (; j + 16 <= n; j += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(s + j), vinv);
    const __m512 e = exp2_16(_mm512_mul_ps(_mm512_abs_ps(y), k));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i signed_t = _mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(y), sign));
    _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_castsi512_ps(signed_t), vcap));
  }
#elif defined(GX_ATTN_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv), vcap = _mm256_set1_ps(cap), k = _mm256_set1_ps(-2.0f * kLog2e);
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; j + 8 <= n; j += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + j), vinv);
    const __m256 e = exp2_8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), k));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign)), vcap));
  }
#endif
  for (; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
}

// a . b over 16 running sums: vectorizes without reordering a float reduction (the portable and
// AVX2 decode scores).
template <typename T>
inline float dot_lanes(const float* a, const T* b, int64_t n) {
  float acc[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[j + l] * to_float(b[j + l]);
  for (; j < n; ++j) acc[j % 16] += a[j] * to_float(b[j]);
  float total = 0.0f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  return total;
}

// ------------------------------------------------------------------------------------------------
// Work distribution: tasks pulled from a shared counter (costs differ: causal tiles, ragged rows),
// run serially when the whole call is too small to be worth waking the thread team.

template <typename F>
void run_tasks(int64_t num_tasks, bool parallel, const F& task) {
  if (num_tasks <= 0) return;
  const int64_t threads =
      parallel && !at::in_parallel_region() ? std::min<int64_t>(at::get_num_threads(), num_tasks) : 1;
  if (threads <= 1) {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) task(i);
  });
}

// A per-thread scratch buffer (reused across calls: no allocation on the hot path).
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// ------------------------------------------------------------------------------------------------
// Shapes and metadata

struct Meta {
  const int64_t* table = nullptr;  // req_to_token
  int64_t table_rows = 0, table_cols = 0, table_stride = 0;
  const int64_t* req = nullptr;  // req_pool_indices
  const int64_t* seq_lens = nullptr;
  const int64_t* loc = nullptr;  // out_cache_loc
  int64_t loc_len = 0;
  const int64_t* prefix = nullptr;  // extend only
  const int64_t* ext_len = nullptr;
  const int64_t* start = nullptr;
  int64_t num_reqs = 0;  // extend: requests; decode: rows (batch size)
  int64_t n_real = 0;    // num_token_non_padded
  int64_t window = 0;    // sliding window (keys per query, its own included); 0: full attention
  bool extend = false;
};

// The first key a query at `pos` attends.
inline int64_t window_start(const Meta& m, int64_t pos) {
  return m.window > 0 ? std::max<int64_t>(0, pos - m.window + 1) : 0;
}

struct Pool {
  void* k = nullptr;
  void* v = nullptr;
  int64_t layers = 0, slots = 0, kv_heads = 0, head_dim = 0;
  at::ScalarType dtype = at::kFloat;
};

const int64_t* int64_data(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
              "paged_attention: ", name, " must be a contiguous 1-D int64 CPU tensor, got ", t.sizes(), " ",
              t.scalar_type(), " on ", t.device());
  return t.data_ptr<int64_t>();
}

Pool pool_of(const at::Tensor& k_pool, const at::Tensor& v_pool) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && k_pool.device().is_cpu(),
              "paged_attention: k_pool must be a contiguous [layers, slots, kv_heads, head_dim] CPU tensor, got ",
              k_pool.sizes());
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes() && v_pool.is_contiguous() &&
                  v_pool.scalar_type() == k_pool.scalar_type(),
              "paged_attention: v_pool must match k_pool");
  const auto dt = k_pool.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "paged_attention: the KV pool must be float32, bfloat16 or float16, got ", dt);
  return Pool{k_pool.data_ptr(), v_pool.data_ptr(), k_pool.size(0), k_pool.size(1), k_pool.size(2), k_pool.size(3), dt};
}

// Checks every index the kernels will follow, once: afterwards they read without bounds checks.
Meta meta_of(const Pool& pool, const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
             const at::Tensor& seq_lens, const at::Tensor& out_cache_loc, const c10::optional<at::Tensor>& prefix,
             const c10::optional<at::Tensor>& ext_len, const c10::optional<at::Tensor>& start, int64_t n_real,
             int64_t window) {
  Meta m;
  m.window = std::max<int64_t>(window, 0);
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong && req_to_token.device().is_cpu() &&
                  req_to_token.stride(1) == 1,
              "paged_attention: req_to_token must be a 2-D int64 CPU tensor with unit column stride");
  m.table = req_to_token.data_ptr<int64_t>();
  m.table_rows = req_to_token.size(0);
  m.table_cols = req_to_token.size(1);
  m.table_stride = req_to_token.stride(0);
  m.req = int64_data(req_pool_indices, "req_pool_indices");
  m.seq_lens = int64_data(seq_lens, "seq_lens");
  m.loc = int64_data(out_cache_loc, "out_cache_loc");
  m.loc_len = out_cache_loc.size(0);
  m.num_reqs = req_pool_indices.size(0);
  m.n_real = n_real;
  TORCH_CHECK(seq_lens.size(0) == m.num_reqs, "paged_attention: seq_lens and req_pool_indices differ in length");
  const bool has_prefix = prefix.has_value() && prefix->defined();
  const bool has_len = ext_len.has_value() && ext_len->defined();
  const bool has_start = start.has_value() && start->defined();
  TORCH_CHECK(has_prefix == has_len && has_len == has_start,
              "paged_attention: extend_prefix_lens, extend_seq_lens and extend_start_loc go together");
  m.extend = has_prefix;
  TORCH_CHECK(0 <= n_real && n_real <= m.loc_len, "paged_attention: num_token_non_padded ", n_real,
              " is outside [0, ", m.loc_len, "]");
  for (int64_t t = 0; t < n_real; ++t) {
    TORCH_CHECK(0 <= m.loc[t] && m.loc[t] < pool.slots, "paged_attention: out_cache_loc[", t, "] = ", m.loc[t],
                " is not a slot of the pool (", pool.slots, ")");
  }
  // Rows that attend: decode rows < n_real; every request in extend.
  int64_t rows = m.num_reqs;
  if (m.extend) {
    m.prefix = int64_data(*prefix, "extend_prefix_lens");
    m.ext_len = int64_data(*ext_len, "extend_seq_lens");
    m.start = int64_data(*start, "extend_start_loc");
    TORCH_CHECK(prefix->size(0) == m.num_reqs && ext_len->size(0) == m.num_reqs && start->size(0) == m.num_reqs,
                "paged_attention: the extend_* tensors must have one entry per request");
  } else {
    TORCH_CHECK(n_real <= m.num_reqs, "paged_attention: decode has ", m.num_reqs, " rows but ", n_real,
                " real tokens");
    rows = n_real;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = m.req[r], len = m.seq_lens[r];
    TORCH_CHECK(0 <= row && row < m.table_rows, "paged_attention: req_pool_indices[", r, "] = ", row,
                " is not a row of req_to_token");
    TORCH_CHECK(0 <= len && len <= m.table_cols, "paged_attention: seq_lens[", r, "] = ", len, " is outside [0, ",
                m.table_cols, "]");
    if (m.extend) {
      TORCH_CHECK(m.ext_len[r] >= 0 && m.prefix[r] >= 0 && m.prefix[r] + m.ext_len[r] == len,
                  "paged_attention: request ", r, ": prefix + extend length != seq_len");
      TORCH_CHECK(m.start[r] >= 0 && m.start[r] + m.ext_len[r] <= n_real, "paged_attention: request ", r,
                  "'s tokens run past num_token_non_padded");
    }
    const int64_t* slots = m.table + row * m.table_stride;
    for (int64_t j = 0; j < len; ++j) {
      TORCH_CHECK(0 <= slots[j] && slots[j] < pool.slots, "paged_attention: req_to_token[", row, ", ", j, "] = ",
                  slots[j], " is not a slot of the pool");
    }
  }
  return m;
}

// ------------------------------------------------------------------------------------------------
// Query-at-a-time attention (decode rows, short extend runs): one task = one query token and
// one kv head (its G query heads) over keys [k0, k1), read from the pool through `slots`.
// Leaves unnormalized acc[G][D] and the running max / sum per head.

constexpr int64_t kKeyBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kBK = kKeyBlock;  // keys per block of the extend tiles too (4 vectors of 16)

// Online-softmax update of one row of kBK scores of which [lo, valid) are live (lo > 0: the
// block starts below a sliding window): the row becomes P = 2^(s - max) (zero outside), m and l
// are updated; returns the factor the row's earlier output must be scaled by.
inline float softmax_row(float* s, float& m, float& l, int64_t valid, int64_t lo = 0) {
#if defined(__AVX512F__)
  __m512 x[4];
  __mmask16 live[4];
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int c = 0; c < 4; ++c) {
    const int64_t left = valid - 16 * c, below = lo - 16 * c;
    live[c] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    if (below > 0) live[c] &= below >= 16 ? 0 : static_cast<__mmask16>(~((1u << below) - 1));
    x[c] = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), live[c], s + 16 * c);
    vmax = _mm512_max_ps(vmax, x[c]);
  }
  const float mx = std::max(m, _mm512_reduce_max_ps(vmax));
  if (mx == kNegInf) {  // nothing live yet
    std::fill(s, s + kBK, 0.0f);
    return 1.0f;
  }
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const __m512 e = _mm512_maskz_mov_ps(live[c], exp2_16(_mm512_sub_ps(x[c], vm)));
    _mm512_storeu_ps(s + 16 * c, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#elif defined(GX_ATTN_AVX2)
  __m256 x[8], live[8];
  __m256 vmax = _mm256_set1_ps(kNegInf);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(valid, 0, kBK)));
  const __m256i lower = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(lo, 0, kBK)) - 1);
  for (int c = 0; c < 8; ++c) {
    const __m256i idx = _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * c));
    live[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(upper, idx), _mm256_cmpgt_epi32(idx, lower)));
    x[c] = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + 8 * c), live[c]);
    vmax = _mm256_max_ps(vmax, x[c]);
  }
  const float mx = std::max(m, hmax8(vmax));
  if (mx == kNegInf) {  // nothing live yet
    std::fill(s, s + kBK, 0.0f);
    return 1.0f;
  }
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int c = 0; c < 8; ++c) {
    const __m256 e = _mm256_and_ps(live[c], exp2_8(_mm256_sub_ps(x[c], vm)));
    _mm256_storeu_ps(s + 8 * c, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float sum = hsum8(vsum);
#else
  float mx = m;
  for (int64_t j = lo; j < valid; ++j) mx = std::max(mx, s[j]);
  if (mx == kNegInf) {
    std::fill(s, s + kBK, 0.0f);
    return 1.0f;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < std::min<int64_t>(lo, kBK); ++j) s[j] = 0.0f;
  for (int64_t j = std::max<int64_t>(lo, 0); j < valid; ++j) {
    s[j] = exp2_scalar(s[j] - mx);
    sum += s[j];
  }
  for (int64_t j = std::max<int64_t>(valid, 0); j < kBK; ++j) s[j] = 0.0f;
#endif
  const float alpha = m == kNegInf ? 0.0f : exp2_scalar(m - mx);
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

constexpr int64_t kPrefetchKeys = 8;  // how far ahead key rows are requested

// One query token against keys [k0, k1) of its request, all kv heads at once (a slot's K or V
// row, kv_heads * head_dim values, is read whole and in order).  q: [heads][D] pre-scaled;
// leaves unnormalized acc [heads][D], running max m and sum l per query head; s: [heads][kKeyBlock].
// cap: the logit soft-cap in base-2 units (0: none).
template <typename KV, int NC>  // NC: head_dim / 16 for the AVX-512 path; 0: any head_dim, portable
void attend_keys(const float* q, int64_t KVH, int64_t G, int64_t D, const KV* k_base, const KV* v_base,
                 int64_t slot_stride, const int64_t* slots, int64_t k0, int64_t k1, float* m, float* l, float* acc,
                 float* s, float cap) {
  const int64_t HQ = KVH * G;
  const int64_t row_bytes = slot_stride * static_cast<int64_t>(sizeof(KV));
  for (int64_t i = 0; i < HQ; ++i) {
    m[i] = kNegInf;
    l[i] = 0.0f;
  }
  std::fill(acc, acc + HQ * D, 0.0f);
  for (int64_t b0 = k0; b0 < k1; b0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, k1 - b0);
    // scores s[head][j]; the block's V rows and the next K rows are requested meanwhile
    for (int64_t j = 0; j < nb; ++j) {
      if (b0 + j + kPrefetchKeys < k1) prefetch_row(k_base + slots[b0 + j + kPrefetchKeys] * slot_stride, row_bytes);
      prefetch_row(v_base + slots[b0 + j] * slot_stride, row_bytes);
      const KV* kp = k_base + slots[b0 + j] * slot_stride;
      for (int64_t h = 0; h < KVH; ++h) {
#if defined(__AVX512F__)
        if constexpr (NC > 0) {
          __m512 kc[NC];
          for (int c = 0; c < NC; ++c) kc[c] = load16(kp + h * D + 16 * c);
          for (int64_t g = 0; g < G; ++g) {
            const float* qh = q + (h * G + g) * D;
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qh), kc[0]);
            for (int c = 1; c < NC; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kc[c], sum);
            s[(h * G + g) * kKeyBlock + j] = _mm512_reduce_add_ps(sum);
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) s[(h * G + g) * kKeyBlock + j] = dot_lanes(q + (h * G + g) * D, kp + h * D, D);
      }
    }
    // online softmax (base 2), then values
    for (int64_t i = 0; i < HQ; ++i) {
      float* si = s + i * kKeyBlock;
      if (cap > 0.0f) softcap_scores(si, nb, cap);
      const float alpha = softmax_row(si, m[i], l[i], nb);
      float* ai = acc + i * D;
      const KV* vh = v_base + (i / G) * D;
#if defined(__AVX512F__)
      if constexpr (NC > 0) {
        __m512 a[NC];
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(ai + 16 * c), va);
        for (int64_t j = 0; j < nb; ++j) {
          const KV* vp = vh + slots[b0 + j] * slot_stride;
          const __m512 p = _mm512_set1_ps(si[j]);
          for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p, load16(vp + 16 * c), a[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ai + 16 * c, a[c]);
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
      for (int64_t j = 0; j < nb; ++j) {
        const KV* vp = vh + slots[b0 + j] * slot_stride;
        const float p = si[j];
        for (int64_t d = 0; d < D; ++d) ai[d] += p * to_float(vp[d]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Blocked extend attention (flash-attention style) for runs of many query tokens.

constexpr int64_t kBQ = 32;  // query tokens per tile
constexpr int kMR = 6;       // query rows per register tile

// Scores of kMR query rows (Q: ld D, pre-scaled) against one packed key block Kt [D][kBK]:
// S [kMR][kBK].
void qk_tile(const float* Q, const float* Kt, float* S, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc[kMR][4];
  for (int i = 0; i < kMR; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* kt = Kt + d * kBK;
    const __m512 k0 = _mm512_loadu_ps(kt), k1 = _mm512_loadu_ps(kt + 16), k2 = _mm512_loadu_ps(kt + 32),
                 k3 = _mm512_loadu_ps(kt + 48);
    for (int i = 0; i < kMR; ++i) {
      const __m512 q = _mm512_set1_ps(Q[i * D + d]);
      acc[i][0] = _mm512_fmadd_ps(q, k0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(q, k1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(q, k2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(q, k3, acc[i][3]);
    }
  }
  for (int i = 0; i < kMR; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + i * kBK + 16 * c, acc[i][c]);
#elif defined(GX_ATTN_AVX2)
  for (int64_t j0 = 0; j0 < kBK; j0 += 16) {  // 16 keys at a time: 12 accumulators fit 16 registers
    __m256 acc[kMR][2];
    for (int i = 0; i < kMR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const float* kt = Kt + d * kBK + j0;
      const __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
      for (int i = 0; i < kMR; ++i) {
        const __m256 q = _mm256_broadcast_ss(Q + i * D + d);
        acc[i][0] = _mm256_fmadd_ps(q, k0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(q, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < kMR; ++i) {
      _mm256_storeu_ps(S + i * kBK + j0, acc[i][0]);
      _mm256_storeu_ps(S + i * kBK + j0 + 8, acc[i][1]);
    }
  }
#else
  for (int i = 0; i < kMR; ++i)
    for (int64_t j = 0; j < kBK; ++j) S[i * kBK + j] = 0.0f;
  for (int64_t d = 0; d < D; ++d)
    for (int i = 0; i < kMR; ++i) {
      const float q = Q[i * D + d];
      for (int64_t j = 0; j < kBK; ++j) S[i * kBK + j] += q * Kt[d * kBK + j];
    }
#endif
}

// O[kMR][D] = O * alpha + P [kMR][kBK] . V [kBK][D]
#if defined(__AVX512F__)
template <int NC>  // columns c0..c0 + 16 * NC
void pv_cols(const float* P, const float* V, float* O, const float* alpha, int64_t D, int64_t c0) {
  __m512 acc[kMR][NC];
  for (int i = 0; i < kMR; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(O + i * D + c0 + 16 * c), a);
  }
  for (int64_t j = 0; j < kBK; ++j) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(V + j * D + c0 + 16 * c);
    for (int i = 0; i < kMR; ++i) {
      const __m512 p = _mm512_set1_ps(P[i * kBK + j]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < kMR; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(O + i * D + c0 + 16 * c, acc[i][c]);
}
#endif

void pv_tile(const float* P, const float* V, float* O, const float* alpha, int64_t D) {
#if defined(__AVX512F__)  // D is a multiple of 16 here
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) pv_cols<4>(P, V, O, alpha, D, c0);
  if (D - c0 == 48) pv_cols<3>(P, V, O, alpha, D, c0);
  if (D - c0 == 32) pv_cols<2>(P, V, O, alpha, D, c0);
  if (D - c0 == 16) pv_cols<1>(P, V, O, alpha, D, c0);
#elif defined(GX_ATTN_AVX2)
  int64_t c0 = 0;
  for (; c0 + 16 <= D; c0 += 16) {  // 16 columns at a time, as qk_tile's keys
    __m256 acc[kMR][2];
    for (int i = 0; i < kMR; ++i) {
      const __m256 a = _mm256_broadcast_ss(alpha + i);
      acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(O + i * D + c0), a);
      acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(O + i * D + c0 + 8), a);
    }
    for (int64_t j = 0; j < kBK; ++j) {
      const __m256 v0 = _mm256_loadu_ps(V + j * D + c0), v1 = _mm256_loadu_ps(V + j * D + c0 + 8);
      for (int i = 0; i < kMR; ++i) {
        const __m256 p = _mm256_broadcast_ss(P + i * kBK + j);
        acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < kMR; ++i) {
      _mm256_storeu_ps(O + i * D + c0, acc[i][0]);
      _mm256_storeu_ps(O + i * D + c0 + 8, acc[i][1]);
    }
  }
  for (int i = 0; i < kMR; ++i) {  // columns past the last 16 (head_dim not a multiple of 16)
    float* o = O + i * D;
    for (int64_t d = c0; d < D; ++d) o[d] *= alpha[i];
    for (int64_t j = 0; j < kBK; ++j)
      for (int64_t d = c0; d < D; ++d) o[d] += P[i * kBK + j] * V[j * D + d];
  }
#else
  for (int i = 0; i < kMR; ++i) {
    float* o = O + i * D;
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha[i];
    for (int64_t j = 0; j < kBK; ++j) {
      const float p = P[i * kBK + j];
      for (int64_t d = 0; d < D; ++d) o[d] += p * V[j * D + d];
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// The whole call

struct Call {
  // activations
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t q_stride, k_stride, v_stride, out_stride;  // row strides (elements)
  int64_t tokens, heads, kv_heads, head_dim, group;
  float scale;  // softmax scale * log2(e)
  float softcap;  // logit soft-cap * log2(e) (the scores' units); 0: none
  // pool (this layer)
  void* k_layer;
  void* v_layer;
  int64_t slot_stride;  // kv_heads * head_dim
};

// Write this step's real k/v rows into the pool.
template <typename A, typename KV>
void write_kv(const Call& c, const Meta& m) {
  const int64_t width = c.kv_heads * c.head_dim;
  const A* k = static_cast<const A*>(c.k);
  const A* v = static_cast<const A*>(c.v);
  KV* kp = static_cast<KV*>(c.k_layer);
  KV* vp = static_cast<KV*>(c.v_layer);
  auto rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      convert_row(k + t * c.k_stride, kp + m.loc[t] * c.slot_stride, width);
      convert_row(v + t * c.v_stride, vp + m.loc[t] * c.slot_stride, width);
    }
  };
  if (m.n_real >= 256 && !at::in_parallel_region()) {
    at::parallel_for(0, m.n_real, 128, rows);
  } else {
    rows(0, m.n_real);
  }
}

template <typename A>
inline void store_out(const Call& c, int64_t t, int64_t head, const float* values, float inv_l) {
  A* o = static_cast<A*>(c.out) + t * c.out_stride + head * c.head_dim;
  for (int64_t d = 0; d < c.head_dim; ++d) o[d] = from_float<A>(values[d] * inv_l);
}

// Query-at-a-time work: one token (all its heads) over its keys, possibly cut into key splits.
struct QueryTask {
  int64_t token;     // activation row
  int64_t req_row;   // row of req_to_token
  int64_t keys;      // keys attended: first..keys-1
  int64_t splits;    // key ranges this token's work is cut into (one task each)
  int64_t partial0;  // index of its first partial (splits > 1)
  int64_t first;     // the first key (its sliding window's start; 0 with none)
};

template <typename A, typename KV, int NC>
void run_query_tasks(const Call& c, const Meta& m, const std::vector<QueryTask>& items, int64_t num_partials,
                     bool parallel) {
  const int64_t D = c.head_dim, HQ = c.heads;
  std::vector<int64_t> first(items.size() + 1, 0);  // task index -> (item, split)
  for (size_t i = 0; i < items.size(); ++i) first[i + 1] = first[i] + items[i].splits;
  // A partial per (split, query head): m, l, acc[D]
  const int64_t part_stride = HQ * (D + 2);
  std::vector<float> partials(num_partials * part_stride);
  const KV* kpool = static_cast<const KV*>(c.k_layer);
  const KV* vpool = static_cast<const KV*>(c.v_layer);
  run_tasks(first.back(), parallel, [&](int64_t task) {
    const int64_t i = items.size() == static_cast<size_t>(first.back())
                          ? task
                          : std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
    const QueryTask& it = items[i];
    const int64_t split = task - first[i];
    const int64_t span = it.keys - it.first, chunk = (span + it.splits - 1) / it.splits;
    const int64_t k0 = std::min(it.keys, it.first + split * chunk), k1 = std::min(it.keys, k0 + chunk);
    thread_local std::vector<float> buf;
    float* qs = scratch(buf, HQ * (2 * D + 2 + kKeyBlock));
    float* acc = qs + HQ * D;
    float* mm = acc + HQ * D;
    float* ll = mm + HQ;
    float* s = ll + HQ;
    load_row(static_cast<const A*>(c.q) + it.token * c.q_stride, qs, HQ * D, c.scale);
    const int64_t* slots = m.table + it.req_row * m.table_stride;
    attend_keys<KV, NC>(qs, c.kv_heads, c.group, D, kpool, vpool, c.slot_stride, slots, k0, k1, mm, ll, acc, s,
                        c.softcap);
    if (it.splits == 1) {
      for (int64_t h = 0; h < HQ; ++h) store_out<A>(c, it.token, h, acc + h * D, ll[h] > 0.0f ? 1.0f / ll[h] : 0.0f);
    } else {
      float* p = partials.data() + (it.partial0 + split) * part_stride;
      for (int64_t h = 0; h < HQ; ++h) {
        p[h * (D + 2)] = mm[h];
        p[h * (D + 2) + 1] = ll[h];
        std::memcpy(p + h * (D + 2) + 2, acc + h * D, D * sizeof(float));
      }
    }
  });
  if (num_partials == 0) return;
  // Combine split partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
  std::vector<float> combined(D);
  for (const QueryTask& it : items) {
    if (it.splits == 1) continue;
    for (int64_t h = 0; h < HQ; ++h) {
      float M = kNegInf;
      for (int64_t sp = 0; sp < it.splits; ++sp)
        M = std::max(M, partials[(it.partial0 + sp) * part_stride + h * (D + 2)]);
      std::fill(combined.begin(), combined.end(), 0.0f);
      float L = 0.0f;
      for (int64_t sp = 0; sp < it.splits; ++sp) {
        const float* p = partials.data() + (it.partial0 + sp) * part_stride + h * (D + 2);
        if (p[1] == 0.0f) continue;  // an empty key range
        const float w = exp2_scalar(p[0] - M);
        L += w * p[1];
        for (int64_t d = 0; d < D; ++d) combined[d] += w * p[2 + d];
      }
      store_out<A>(c, it.token, h, combined.data(), L > 0.0f ? 1.0f / L : 0.0f);
    }
  }
}

// Splits so that few long rows still keep every thread busy: at least kMinSplitKeys per split.
constexpr int64_t kMinSplitKeys = 256;
// Below this many (key, kv head) reads a call runs on the calling thread alone.
constexpr int64_t kParallelKeyHeads = 1024;

template <typename A, typename KV, int NC>
void decode(const Call& c, const Meta& m) {
  std::vector<QueryTask> items;
  items.reserve(m.n_real);
  int64_t total = 0;
  for (int64_t b = 0; b < m.n_real; ++b) {
    // The row's query sits at seq_len - 1 (decode and verify rows alike).
    const int64_t first = window_start(m, m.seq_lens[b] - 1);
    items.push_back(QueryTask{b, m.req[b], m.seq_lens[b], 1, 0, first});
    total += m.seq_lens[b] - first;
  }
  const int64_t threads = at::get_num_threads();
  const bool parallel = total * c.kv_heads >= kParallelKeyHeads && threads > 1;
  int64_t partials = 0;
  const int64_t base_tasks = static_cast<int64_t>(items.size());
  if (parallel && base_tasks < 4 * threads) {
    const int64_t want = (4 * threads + base_tasks - 1) / std::max<int64_t>(base_tasks, 1);
    for (QueryTask& it : items) {
      it.splits = std::max<int64_t>(1, std::min(want, (it.keys - it.first) / kMinSplitKeys));
      if (it.splits > 1) {
        it.partial0 = partials;
        partials += it.splits;
      }
    }
  }
  run_query_tasks<A, KV, NC>(c, m, items, partials, parallel);
}

// Extend: requests of up to this many tokens run query-at-a-time (no packing).
constexpr int64_t kShortRun = 4;

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

template <typename A, typename KV, int NC>
void extend(const Call& c, const Meta& m) {
  // The tiled kernels take any head_dim when portable, multiples of 16 with AVX-512.
  constexpr bool tiled = NC > 0 || !kAvx512;
  const int64_t G = c.group, D = c.head_dim, H = c.kv_heads;
  // Short runs (decode rows of a MIXED batch, one-token chunks): query at a time.
  std::vector<QueryTask> short_items;
  std::vector<int64_t> long_reqs;
  int64_t short_work = 0;
  for (int64_t r = 0; r < m.num_reqs; ++r) {
    const int64_t len = m.ext_len[r];
    if (len == 0) continue;
    if (!tiled || len <= kShortRun) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t pos = m.prefix[r] + i, first = window_start(m, pos);
        short_items.push_back(QueryTask{m.start[r] + i, m.req[r], pos + 1, 1, 0, first});
        short_work += pos + 1 - first;
      }
    } else {
      long_reqs.push_back(r);
    }
  }
  if (!short_items.empty()) {
    run_query_tasks<A, KV, NC>(c, m, short_items, 0, short_work * H >= kParallelKeyHeads);
  }
  if constexpr (tiled) {
    if (long_reqs.empty()) return;
    // Pack each long request's keys: Kt blocks [nb][D][kBK] and V rows [nb * kBK][D], fp32,
    // zero past the last key.  Offsets per (request, kv head).
    std::vector<int64_t> pack_off(long_reqs.size() + 1, 0);
    for (size_t i = 0; i < long_reqs.size(); ++i) {
      const int64_t nb = (m.seq_lens[long_reqs[i]] + kBK - 1) / kBK;
      pack_off[i + 1] = pack_off[i] + H * nb * kBK * D * 2;
    }
    thread_local std::vector<float> packed_buf;
    float* packed = scratch(packed_buf, pack_off.back());
    const KV* kpool = static_cast<const KV*>(c.k_layer);
    const KV* vpool = static_cast<const KV*>(c.v_layer);
    // Pack tasks: (request, kv head, key block).
    std::vector<int64_t> pack_first(long_reqs.size() + 1, 0);
    for (size_t i = 0; i < long_reqs.size(); ++i)
      pack_first[i + 1] = pack_first[i] + H * ((m.seq_lens[long_reqs[i]] + kBK - 1) / kBK);
    run_tasks(pack_first.back(), true, [&](int64_t task) {
      const int64_t i = std::upper_bound(pack_first.begin(), pack_first.end(), task) - pack_first.begin() - 1;
      const int64_t r = long_reqs[i], S = m.seq_lens[r], nb = (S + kBK - 1) / kBK;
      const int64_t h = (task - pack_first[i]) / nb, blk = (task - pack_first[i]) % nb;
      // Blocks wholly below the first new token's window are never read (no tile starts lower).
      if ((blk + 1) * kBK <= window_start(m, m.prefix[r])) return;
      float* base = packed + pack_off[i] + h * nb * kBK * D * 2;
      float* kt = base + blk * D * kBK;
      float* vr = base + nb * kBK * D + blk * kBK * D;
      const int64_t* slots = m.table + m.req[r] * m.table_stride;
      float row[512];
      for (int64_t j = 0; j < kBK; ++j) {
        const int64_t key = blk * kBK + j;
        if (key < S) {
          load_row(kpool + slots[key] * c.slot_stride + h * D, row, D, 1.0f);
          for (int64_t d = 0; d < D; ++d) kt[d * kBK + j] = row[d];
          load_row(vpool + slots[key] * c.slot_stride + h * D, vr + j * D, D, 1.0f);
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * kBK + j] = 0.0f;
          std::fill(vr + j * D, vr + (j + 1) * D, 0.0f);
        }
      }
    });
    // Compute tasks: (request, kv head, query tile), the costliest (last tiles: most keys) first.
    struct Tile {
      int64_t i, h, t0, t1, cost;
    };
    std::vector<Tile> tiles;
    for (size_t i = 0; i < long_reqs.size(); ++i) {
      const int64_t r = long_reqs[i];
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t0 = 0; t0 < m.ext_len[r]; t0 += kBQ) {
          const int64_t t1 = std::min(m.ext_len[r], t0 + kBQ);
          const int64_t keys = m.prefix[r] + t1 - window_start(m, m.prefix[r] + t0);
          tiles.push_back(Tile{static_cast<int64_t>(i), h, t0, t1, keys * (t1 - t0)});
        }
    }
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
    run_tasks(static_cast<int64_t>(tiles.size()), true, [&](int64_t task) {
      const Tile& tile = tiles[task];
      const int64_t r = long_reqs[tile.i], S = m.seq_lens[r], nb_all = (S + kBK - 1) / kBK, prefix = m.prefix[r];
      const float* base = packed + pack_off[tile.i] + tile.h * nb_all * kBK * D * 2;
      const float* Kp = base;
      const float* Vp = base + nb_all * kBK * D;
      const int64_t n_tok = tile.t1 - tile.t0;
      const int64_t rows = n_tok * G, rows_pad = (rows + kMR - 1) / kMR * kMR;
      thread_local std::vector<float> buf;
      float* Q = scratch(buf, rows_pad * (2 * D + kBK + 3));
      float* O = Q + rows_pad * D;
      float* S_ = O + rows_pad * D;
      float* mrow = S_ + rows_pad * kBK;
      float* lrow = mrow + rows_pad;
      float* alpha = lrow + rows_pad;
      // rows g-major: row = g * n_tok + t
      for (int64_t t = 0; t < n_tok; ++t) {
        const A* qt = static_cast<const A*>(c.q) + (m.start[r] + tile.t0 + t) * c.q_stride + tile.h * G * D;
        for (int64_t g = 0; g < G; ++g) load_row(qt + g * D, Q + (g * n_tok + t) * D, D, c.scale);
      }
      std::fill(Q + rows * D, Q + rows_pad * D, 0.0f);
      std::fill(O, O + rows_pad * D, 0.0f);
      std::fill(mrow, mrow + rows_pad, kNegInf);
      std::fill(lrow, lrow + rows_pad, 0.0f);
      const int64_t first_limit = prefix + tile.t0;     // key limit (inclusive) of the tile's first token
      const int64_t last_limit = prefix + tile.t1 - 1;  // ... and of its last
      const int64_t nb = last_limit / kBK + 1;
      // Under a sliding window: blocks wholly below the first token's window are skipped, and a
      // row's keys start at its own window (the last token's start is the latest).
      const int64_t first_start = window_start(m, first_limit), last_start = window_start(m, last_limit);
      for (int64_t blk = first_start / kBK; blk < nb; ++blk) {
        const float* Kt = Kp + blk * D * kBK;
        const float* V = Vp + blk * kBK * D;
        for (int64_t i0 = 0; i0 < rows_pad; i0 += kMR) qk_tile(Q + i0 * D, Kt, S_ + i0 * kBK, D);
        if (c.softcap > 0.0f) softcap_scores(S_, rows * kBK, c.softcap);  // before any masking
        const int64_t key0 = blk * kBK;
        const bool full = key0 + kBK - 1 <= first_limit && key0 >= last_start;
        for (int64_t row = 0; row < rows_pad; ++row) {
          int64_t valid = kBK, lo = 0;
          if (!full) {
            const int64_t limit = row < rows ? prefix + tile.t0 + row % n_tok : last_limit;
            valid = std::clamp<int64_t>(limit - key0 + 1, 0, kBK);
            lo = std::clamp<int64_t>(window_start(m, limit) - key0, 0, kBK);
          }
          if (valid <= lo) {
            alpha[row] = 1.0f;
            std::fill(S_ + row * kBK, S_ + (row + 1) * kBK, 0.0f);
          } else {
            alpha[row] = softmax_row(S_ + row * kBK, mrow[row], lrow[row], valid, lo);
          }
        }
        for (int64_t i0 = 0; i0 < rows_pad; i0 += kMR) pv_tile(S_ + i0 * kBK, V, O + i0 * D, alpha + i0, D);
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t g = row / n_tok, t = row % n_tok;
        store_out<A>(c, m.start[r] + tile.t0 + t, tile.h * G + g, O + row * D, 1.0f / lrow[row]);
      }
    });
  }
}

template <typename A, typename KV, int NC>
void run_typed(const Call& c, const Meta& m) {
  write_kv<A, KV>(c, m);
  if (m.extend) {
    extend<A, KV, NC>(c, m);
  } else {
    decode<A, KV, NC>(c, m);
  }
}

template <typename A, typename KV>
void run_head_dim(const Call& c, const Meta& m) {
#if defined(__AVX512F__)
  switch (c.head_dim) {
    case 16: return run_typed<A, KV, 1>(c, m);
    case 32: return run_typed<A, KV, 2>(c, m);
    case 64: return run_typed<A, KV, 4>(c, m);
    case 128: return run_typed<A, KV, 8>(c, m);
    default: break;
  }
#endif
  run_typed<A, KV, 0>(c, m);
}

template <typename A>
void run_activation(const Call& c, const Meta& m, at::ScalarType kv) {
  switch (kv) {
    case at::kFloat: return run_head_dim<A, float>(c, m);
    case at::kBFloat16: return run_head_dim<A, c10::BFloat16>(c, m);
    case at::kHalf: return run_head_dim<A, c10::Half>(c, m);
    default: TORCH_CHECK(false, "paged_attention: unsupported KV dtype ", kv);
  }
}

// scale: the softmax scale (0 or less: head_dim^-0.5); softcap: the logit soft-cap (0 or less: none).
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, int64_t layer_id,
         const Pool& pool, const Meta& m, double scale, double softcap) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "paged_attention: activations must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt,
              "paged_attention: q, k, v and out must share a dtype");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && out.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && out.dim() == 2,
              "paged_attention: q, k, v and out must be 2-D [tokens, heads * head_dim]");
  const int64_t D = pool.head_dim, KVH = pool.kv_heads, T = q.size(0);
  TORCH_CHECK(q.size(1) % D == 0, "paged_attention: q width ", q.size(1), " is not a multiple of head_dim ", D);
  const int64_t HQ = q.size(1) / D;
  TORCH_CHECK(HQ % KVH == 0, "paged_attention: ", HQ, " query heads do not group over ", KVH, " kv heads");
  TORCH_CHECK(k.size(1) == KVH * D && v.size(1) == KVH * D && out.sizes() == q.sizes() && k.size(0) == T &&
                  v.size(0) == T,
              "paged_attention: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", out ", out.sizes(),
              " do not fit a pool of ", KVH, " kv heads x ", D);
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1 && out.stride(1) == 1,
              "paged_attention: q, k, v and out need unit column stride");
  TORCH_CHECK(0 <= layer_id && layer_id < pool.layers, "paged_attention: layer ", layer_id, " is not in the pool (",
              pool.layers, " layers)");
  TORCH_CHECK(m.loc_len == T, "paged_attention: out_cache_loc has ", m.loc_len, " rows for ", T, " tokens");
  TORCH_CHECK(m.extend || m.num_reqs == T, "paged_attention: decode has ", m.num_reqs, " rows for ", T, " tokens");
  TORCH_CHECK(D <= 512, "paged_attention: head_dim ", D, " > 512");
  const int64_t elem = pool.dtype == at::kFloat ? 4 : 2;
  const int64_t layer_bytes = pool.slots * KVH * D * elem;
  Call c{q.data_ptr(),
         k.data_ptr(),
         v.data_ptr(),
         out.data_ptr(),
         q.stride(0),
         k.stride(0),
         v.stride(0),
         out.stride(0),
         T,
         HQ,
         KVH,
         D,
         HQ / KVH,
         static_cast<float>(scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(D))) * kLog2e,
         softcap > 0.0 ? static_cast<float>(softcap * static_cast<double>(kLog2e)) : 0.0f,
         static_cast<char*>(pool.k) + layer_id * layer_bytes,
         static_cast<char*>(pool.v) + layer_id * layer_bytes,
         KVH * D};
  // Padded rows (and, in extend, any row no request covers: none in practice) stay zero.
  int64_t zero_from = m.n_real;
  if (m.extend) {
    int64_t covered = 0;
    for (int64_t r = 0; r < m.num_reqs; ++r) covered += m.ext_len[r];
    if (covered < m.n_real) zero_from = 0;
  }
  const int64_t row_bytes = HQ * D * out.element_size();
  char* out_bytes = static_cast<char*>(out.data_ptr());
  for (int64_t t = zero_from; t < T; ++t) std::memset(out_bytes + t * out.stride(0) * out.element_size(), 0, row_bytes);
  switch (dt) {
    case at::kFloat: return run_activation<float>(c, m, pool.dtype);
    case at::kBFloat16: return run_activation<c10::BFloat16>(c, m, pool.dtype);
    case at::kHalf: return run_activation<c10::Half>(c, m, pool.dtype);
    default: break;
  }
}

// ------------------------------------------------------------------------------------------------
// Ops

void paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                         at::Tensor& k_pool, at::Tensor& v_pool, int64_t layer_id, const at::Tensor& req_to_token,
                         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                         const at::Tensor& out_cache_loc, const c10::optional<at::Tensor>& extend_prefix_lens,
                         const c10::optional<at::Tensor>& extend_seq_lens,
                         const c10::optional<at::Tensor>& extend_start_loc, int64_t num_token_non_padded,
                         int64_t sliding_window, double scale, double logit_softcap) {
  const Pool pool = pool_of(k_pool, v_pool);
  const Meta m = meta_of(pool, req_to_token, req_pool_indices, seq_lens, out_cache_loc, extend_prefix_lens,
                         extend_seq_lens, extend_start_loc, num_token_non_padded, sliding_window);
  run(q, k, v, out, layer_id, pool, m, scale, logit_softcap);
}

// This thread's forward.  The binding holds weak references only: a strong one would keep a
// Python-owned tensor alive, and dropping it at thread exit (the engine loop's end, at
// interpreter shutdown) would need the GIL.  A binding whose tensors are gone is dropped on use.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Binding {
  bool armed = false;
  std::vector<WeakTensor> watched;
  Pool pool;
  Meta meta;  // its window: every layer's, unless `windows` holds one per layer
  std::vector<int64_t> windows;  // per layer (empty: meta.window for all)
  double scale = 0.0, softcap = 0.0;

  bool alive() const {
    for (const WeakTensor& w : watched)
      if (w.expired()) return false;
    return true;
  }
};

Binding& binding() {
  thread_local Binding b;
  return b;
}

void attention_bind(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& req_to_token,
                    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& out_cache_loc,
                    const c10::optional<at::Tensor>& extend_prefix_lens,
                    const c10::optional<at::Tensor>& extend_seq_lens,
                    const c10::optional<at::Tensor>& extend_start_loc, int64_t num_token_non_padded,
                    at::IntArrayRef sliding_windows, double scale, double logit_softcap) {
  Binding& b = binding();
  b.armed = false;
  b.watched.clear();
  TORCH_CHECK(!sliding_windows.empty(), "attention_bind: sliding_windows needs one entry per layer, or one for all");
  b.pool = pool_of(k_pool, v_pool);
  b.meta = meta_of(b.pool, req_to_token, req_pool_indices, seq_lens, out_cache_loc, extend_prefix_lens,
                   extend_seq_lens, extend_start_loc, num_token_non_padded, sliding_windows[0]);
  b.windows.clear();
  if (sliding_windows.size() > 1)
    for (const int64_t w : sliding_windows) b.windows.push_back(std::max<int64_t>(w, 0));
  b.scale = scale;
  b.softcap = logit_softcap;
  for (const at::Tensor* t : {&k_pool, &v_pool, &req_to_token, &req_pool_indices, &seq_lens, &out_cache_loc})
    b.watched.emplace_back(t->getIntrusivePtr());
  for (const auto* t : {&extend_prefix_lens, &extend_seq_lens, &extend_start_loc})
    if (t->has_value() && (*t)->defined()) b.watched.emplace_back((*t)->getIntrusivePtr());
  b.armed = true;
}

void attention_unbind() {
  Binding& b = binding();
  b.armed = false;
  b.watched.clear();
}

void attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                   c10::SymInt layer_id) {
  Binding& b = binding();
  if (b.armed && !b.alive()) attention_unbind();
  if (!b.armed) {
    static const auto python_route = c10::Dispatcher::singleton()
                                         .findSchemaOrThrow("graphexec::attention_py", "")
                                         .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     at::Tensor&, c10::SymInt)>();
    python_route.call(q, k, v, out, std::move(layer_id));
    return;
  }
  const int64_t layer = layer_id.expect_int();
  if (b.windows.empty()) return run(q, k, v, out, layer, b.pool, b.meta, b.scale, b.softcap);
  TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(b.windows.size()), "attention: layer ", layer,
              " has no sliding window in the binding (", b.windows.size(), " layers)");
  Meta m = b.meta;
  m.window = b.windows[layer];
  run(q, k, v, out, layer, b.pool, m, b.scale, b.softcap);
}

}  // namespace

TORCH_LIBRARY_IMPL(graphexec, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
}

// No tensor arguments: registered for every key (the dispatcher cannot pick a backend).
TORCH_LIBRARY_IMPL(graphexec, CatchAll, m) {
  m.impl("attention_bind", &attention_bind);
  m.impl("attention_unbind", &attention_unbind);
}
