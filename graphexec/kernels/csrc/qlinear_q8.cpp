// Block-quantized linear with 8-bit activations, for graphexec::qlinear_q8 (schema in
// graphexec/quant/ops.py; `model.activations=q8`).  The weight layout is qview.h's.
//
// Each call quantizes its activation rows once, per 32-element block: d = max|x| / 127, q =
// round-half-even(x * 127 / max|x|), and s = d * sum(q).  A block's dot product is then integer:
//   sum_j (dw*qw_j + mw) * (dx*qx_j) = dw*dx * sum_j qw_j*qx_j + mw * s
// so a 4-bit block costs one unsigned-by-signed byte dot product and one scale fma, not 32
// dequantizing fmas, and reads a quarter of the activation bytes.  8-bit weights take the same
// form with their codes offset to unsigned (qw + 128, mw = -128 dw) where the dot instruction
// wants unsigned bytes, or llama.cpp's sign trick where the 16-bit pair sums could overflow.
//
// Paths, by what the build's flags allow (graphexec/kernels/__init__.py ISA_FLAGS):
//   AVX512-VNNI  vpdpbusd on 512 bits, two blocks per instruction
//   AVX512BW     vpmaddubsw + vpmaddwd on 512 bits
//   AVX-VNNI     vpdpbusd on 256 bits (VEX), one block per instruction
//   AVX2         vpmaddubsw + vpmaddwd on 256 bits
//   portable     scalar integer loops
// Every path quantizes identically and sums the same integers; only the float accumulation order
// of the block terms differs.  (tests/test_quant_q8.py; tests/test_kernel_isa.py across paths.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qview.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define GX_Q8_ZMM 1
#if defined(__AVX512VNNI__)
#define GX_Q8_VNNI 1
#endif
#elif defined(__AVX2__)
#define GX_Q8_YMM 1
#if defined(__AVXVNNI__)
#define GX_Q8_VNNI 1
#endif
#endif

namespace {

using graphexec_kernels::kBlock;
using graphexec_kernels::QView;
using graphexec_kernels::view_of;

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// Quantized activation rows.  The 512-bit path reads two blocks per instruction in the order its
// unpacked weights come in ([b0 0:16, b1 0:16, b0 16:32, b1 16:32] per block pair), so the rows
// are stored in that order; every other path keeps each block's natural order.  d and s are
// zero-padded to whole 16-float vectors (padding blocks contribute nothing).
struct Q8Rows {
  int64_t m, blocks, q_stride, s_stride;
  std::vector<int8_t> q;
  std::vector<float> d, s;

  Q8Rows(int64_t rows, int64_t nblocks)
      : m(rows),
        blocks(nblocks),
        q_stride(round_up(nblocks, 2) * kBlock),
        s_stride(round_up(nblocks, 16)),
        q(rows * q_stride, 0),
        d(rows * s_stride, 0.0f),
        s(rows * s_stride, 0.0f) {}

  const int8_t* q_row(int64_t i) const { return q.data() + i * q_stride; }
  const float* d_row(int64_t i) const { return d.data() + i * s_stride; }
  const float* s_row(int64_t i) const { return s.data() + i * s_stride; }
};

// Where element j of block b lands in its row.
inline int64_t q_offset(int64_t b, int j) {
#if defined(GX_Q8_ZMM)
  return (b / 2) * 64 + (j >= 16 ? 32 : 0) + (b % 2) * 16 + (j % 16);
#else
  return b * kBlock + j;
#endif
}

void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.0f;
    const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      // nearbyint rounds half to even under the default rounding mode, as the vector converts do.
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      q[q_offset(b, j)] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

#if defined(GX_Q8_ZMM)
// The same arithmetic on 512 bits (products and max are exact, so the codes equal quantize_row's).
void quantize_row_zmm(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const __m512 inverse = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + q_offset(b, 0)), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + q_offset(b, 16)), _mm512_cvtepi32_epi8(qhi));
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}
#endif

Q8Rows quantize(const float* x, int64_t m, int64_t k) {
  Q8Rows rows(m, k / kBlock);
  // A few rows are microseconds of work: no parallel region for decode.
  at::parallel_for(0, m, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int8_t* q = rows.q.data() + i * rows.q_stride;
      float* d = rows.d.data() + i * rows.s_stride;
      float* s = rows.s.data() + i * rows.s_stride;
#if defined(GX_Q8_ZMM)
      quantize_row_zmm(x + i * k, rows.blocks, q, d, s);
#else
      quantize_row(x + i * k, rows.blocks, q, d, s);
#endif
    }
  });
  return rows;
}

#if defined(GX_Q8_ZMM)
// Block pair (b, b+1) of a weight row as unsigned (or, for 8-bit without VNNI, signed) bytes in the
// activation rows' pair order.  `both` is false for the lone last block of an odd row.
template <bool FOUR>
inline __m512i load_pair(const uint8_t* row, int64_t b, bool both) {
  if constexpr (FOUR) {
    const uint8_t* at = row + b * (kBlock / 2);
    const __m256i raw = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    const uint8_t* at = row + b * kBlock;
    const __m512i raw = both ? _mm512_loadu_si512(at)
                             : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    const __m512i ordered = _mm512_shuffle_i64x2(raw, raw, _MM_SHUFFLE(3, 1, 2, 0));
#if defined(GX_Q8_VNNI)
    return _mm512_xor_si512(ordered, _mm512_set1_epi8(static_cast<char>(0x80)));
#else
    return ordered;
#endif
  }
}

// 16 int32 lanes, four per half block, of w . x.
template <bool FOUR>
inline __m512i dot_pair(__m512i w, __m512i x) {
#if defined(GX_Q8_VNNI)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
  if constexpr (FOUR) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
  } else {
    // |w| * (x with w's sign): pairs stay within int16 (2 * 128 * 127), unlike (w + 128) * x.
    const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x), _mm512_set1_epi16(1));
  }
#endif
}

// Whether the block offsets mw * s enter the sum: 4-bit always, 8-bit only when offset to unsigned.
template <bool FOUR>
constexpr bool kHasOffset =
#if defined(GX_Q8_VNNI)
    true;
#else
    FOUR;
#endif

// out[i, r + n] for MT activation rows from i0 and NR weight rows from r.  The min/offset term
// is folded into the same accumulator: only the lanes' total is read.
template <bool FOUR, int MT, int NR>
void tile(const QView& w, int64_t r, const Q8Rows& a, int64_t i0, float* out, int64_t ldo) {
  __m512 acc[MT][NR];
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_setzero_ps();
  const uint8_t* rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = w.codes + (r + n) * w.row_bytes;
  const int64_t block_bytes = w.row_bytes / w.blocks;
  // Lane l of a pair's dot belongs to block (l / 4) % 2 of the pair.
  const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t g = 0; g < w.blocks; g += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, w.blocks - g));
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    __m512 dw[NR];
    for (int n = 0; n < NR; ++n) {
      const int64_t at = (r + n) * w.blocks + g;
      dw[n] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scales + at));
      if constexpr (kHasOffset<FOUR>) {
        const __m512 mw = FOUR ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.mins + at))
                               : _mm512_mul_ps(dw[n], _mm512_set1_ps(-128.0f));
        for (int i = 0; i < MT; ++i) acc[i][n] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(a.s_row(i0 + i) + g), acc[i][n]);
      }
      // The next rows stream after these: ask for them ahead of the hardware prefetcher (as the
      // float kernel does; it measured faster there).
      const uint8_t* ahead = rows[n] + NR * w.row_bytes + g * block_bytes;
      for (int64_t off = 0; off < block_bytes * count; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    }
    __m512 dx[MT];
    for (int i = 0; i < MT; ++i) dx[i] = _mm512_loadu_ps(a.d_row(i0 + i) + g);
    for (int p = 0; 2 * p < count; ++p) {
      const int64_t b = g + 2 * p;
      const bool both = 2 * p + 1 < count;
      const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(2 * p));
      __m512i wv[NR];
      __m512 sw[NR];
      for (int n = 0; n < NR; ++n) {
        wv[n] = load_pair<FOUR>(rows[n], b, both);
        sw[n] = _mm512_permutexvar_ps(lanes, dw[n]);
      }
      for (int i = 0; i < MT; ++i) {
        const __m512i xv = _mm512_loadu_si512(a.q_row(i0 + i) + b * kBlock);
        const __m512 sx = _mm512_permutexvar_ps(lanes, dx[i]);
        for (int n = 0; n < NR; ++n) {
          const __m512 sums = _mm512_cvtepi32_ps(dot_pair<FOUR>(wv[n], xv));
          acc[i][n] = _mm512_fmadd_ps(sums, _mm512_mul_ps(sw[n], sx), acc[i][n]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) out[(i0 + i) * ldo + r + n] = _mm512_reduce_add_ps(acc[i][n]);
}

template <int MT>
constexpr int kTileRows = MT >= 4 ? 2 : 4;

#elif defined(GX_Q8_YMM)
// One block of a weight row as bytes in natural order (unsigned; 8-bit offset by 128 under VNNI).
template <bool FOUR>
inline __m256i load_block(const uint8_t* row, int64_t b) {
  if constexpr (FOUR) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
#if defined(GX_Q8_VNNI)
    return _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
    return raw;
#endif
  }
}

template <bool FOUR>
inline __m256i dot_block(__m256i w, __m256i x) {
#if defined(GX_Q8_VNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (FOUR) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  else return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
#endif
}

template <bool FOUR>
constexpr bool kHasOffset =
#if defined(GX_Q8_VNNI)
    true;
#else
    FOUR;
#endif

template <bool FOUR, int MT, int NR>
void tile(const QView& w, int64_t r, const Q8Rows& a, int64_t i0, float* out, int64_t ldo) {
  __m256 acc[MT][NR];
  float offset[MT][NR] = {};
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) acc[i][n] = _mm256_setzero_ps();
  const uint8_t* rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = w.codes + (r + n) * w.row_bytes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i wv[NR];
    float dw[NR], mw[NR];
    for (int n = 0; n < NR; ++n) {
      wv[n] = load_block<FOUR>(rows[n], b);
      dw[n] = static_cast<float>(w.scales[(r + n) * w.blocks + b]);
      mw[n] = FOUR ? static_cast<float>(w.mins[(r + n) * w.blocks + b]) : -128.0f * dw[n];
    }
    for (int i = 0; i < MT; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_row(i0 + i) + b * kBlock));
      const float dx = a.d_row(i0 + i)[b], sx = a.s_row(i0 + i)[b];
      for (int n = 0; n < NR; ++n) {
        const __m256 sums = _mm256_cvtepi32_ps(dot_block<FOUR>(wv[n], xv));
        acc[i][n] = _mm256_fmadd_ps(sums, _mm256_set1_ps(dw[n] * dx), acc[i][n]);
        if constexpr (kHasOffset<FOUR>) offset[i][n] = std::fma(mw[n], sx, offset[i][n]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) {
      const __m256 v = acc[i][n];
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
      out[(i0 + i) * ldo + r + n] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1))) + offset[i][n];
    }
}

template <int MT>
constexpr int kTileRows = MT >= 4 ? 2 : 4;

#else
template <bool FOUR, int MT, int NR>
void tile(const QView& w, int64_t r, const Q8Rows& a, int64_t i0, float* out, int64_t ldo) {
  for (int i = 0; i < MT; ++i) {
    const int8_t* x = a.q_row(i0 + i);
    for (int n = 0; n < NR; ++n) {
      const uint8_t* row = w.codes + (r + n) * w.row_bytes;
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int8_t* xb = x + b * kBlock;
        int sum = 0;
        if constexpr (FOUR) {
          const uint8_t* qb = row + b * (kBlock / 2);
          for (int j = 0; j < 16; ++j) sum += (qb[j] & 0x0F) * xb[j] + (qb[j] >> 4) * xb[j + 16];
        } else {
          const int8_t* qb = reinterpret_cast<const int8_t*>(row) + b * kBlock;
          for (int j = 0; j < kBlock; ++j) sum += qb[j] * xb[j];
        }
        const float dw = static_cast<float>(w.scales[(r + n) * w.blocks + b]);
        acc = std::fma(dw * a.d_row(i0 + i)[b], static_cast<float>(sum), acc);
        if constexpr (FOUR) acc = std::fma(static_cast<float>(w.mins[(r + n) * w.blocks + b]), a.s_row(i0 + i)[b], acc);
      }
      out[(i0 + i) * ldo + r + n] = acc;
    }
  }
}

template <int MT>
constexpr int kTileRows = 1;
#endif

template <bool FOUR, int MT>
void rows_tile(const QView& w, int64_t r0, int64_t r1, const Q8Rows& a, int64_t i0, float* out) {
  constexpr int NR = kTileRows<MT>;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) tile<FOUR, MT, NR>(w, r, a, i0, out, w.n);
  for (; r < r1; ++r) tile<FOUR, MT, 1>(w, r, a, i0, out, w.n);
}

constexpr int64_t kRowChunk = 16;  // weight rows per task, reused across the M tiles

template <bool FOUR>
void stream(const QView& w, const Q8Rows& a, float* out) {
  at::parallel_for(0, (w.n + kRowChunk - 1) / kRowChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t r0 = c0 * kRowChunk, r1 = std::min(w.n, c1 * kRowChunk);
    for (int64_t rs = r0; rs < r1; rs += kRowChunk) {
      const int64_t re = std::min(r1, rs + kRowChunk);
      int64_t i = 0;
      for (; i + 4 <= a.m; i += 4) rows_tile<FOUR, 4>(w, rs, re, a, i, out);
      for (; i + 2 <= a.m; i += 2) rows_tile<FOUR, 2>(w, rs, re, a, i, out);
      for (; i < a.m; ++i) rows_tile<FOUR, 1>(w, rs, re, a, i, out);
    }
  });
}

at::Tensor qlinear_q8_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins) {
  const QView w = view_of(codes, scales, mins);
  TORCH_CHECK(x.size(-1) == w.k, "qlinear_q8: input has ", x.size(-1), " features, the weight takes ", w.k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qlinear_q8: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = w.n;
  const at::Tensor x32 = x.reshape({-1, w.k}).to(at::kFloat).contiguous();
  const int64_t m = x32.size(0);
  at::Tensor out = at::empty({m, w.n}, x32.options());
  if (m > 0) {
    const Q8Rows a = quantize(x32.data_ptr<float>(), m, w.k);
    if (w.four_bit) stream<true>(w, a, out.data_ptr<float>());
    else stream<false>(w, a, out.data_ptr<float>());
  }
  return out.to(x.scalar_type()).view(out_shape);
}

// The activation quantization alone (codes in natural order, d, s), for tests and references.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.size(-1) % kBlock == 0, "quantize_q8: the last dimension ", x.size(-1), " is not a multiple of 32");
  const at::Tensor x32 = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t m = x32.size(0), k = x32.size(1), blocks = k / kBlock;
  const Q8Rows a = quantize(x32.data_ptr<float>(), m, k);
  at::Tensor q = at::empty({m, k}, x32.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, blocks}, x32.options()), s = at::empty({m, blocks}, x32.options());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      for (int j = 0; j < kBlock; ++j) q.data_ptr<int8_t>()[i * k + b * kBlock + j] = a.q_row(i)[q_offset(b, j)];
      d.data_ptr<float>()[i * blocks + b] = a.d_row(i)[b];
      s.data_ptr<float>()[i * blocks + b] = a.s_row(i)[b];
    }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> block_shape = shape;
  block_shape.back() = blocks;
  return {q.view(shape), d.view(block_shape), s.view(block_shape)};
}

}  // namespace

TORCH_LIBRARY_IMPL(graphexec, CPU, m) {
  m.impl("qlinear_q8", &qlinear_q8_cpu);
  m.impl("quantize_q8", &quantize_q8_cpu);
}
