// Block-quantized linear (GGUF Q4_0 / Q4_1 / Q8_0 layouts) on CPU with float activations, for
// graphexec::qlinear and graphexec::qdequantize (schemas are defined in Python:
// graphexec/quant/ops.py).  qlinear_q8.cpp is the 8-bit activation twin, on rows repacked in
// groups of 16.
//
// Weight layout (graphexec/quant/formats.py packs it at load):
//   4-bit: codes uint8 [N, K/2]; per 32-element block, byte j holds element j (low nibble) and
//          element j+16 (high nibble), as GGUF stores it.  value = d * q + m.
//   8-bit: codes int8 [N, K]; value = d * q.
//   scales (d) and mins (m): float16 [N, K/32]; Q4_0 is packed as m = -8 d (exact in fp16).
//
// On AVX-512 each block is dequantized in registers with one fma per lane (d*q is exact in fp32, so
// the weight equals gguf's fp32 dequantization bit for bit); only the dot product's summation order
// differs from a dense fp32 matmul.  The AVX2 path factors the block instead (d * sum x q + m * sum
// x, so each code is converted and multiplied once): the same sum, rounded in another order.
// Small M (decode rows) streams the blocks once per tile of M rows; large M (prefill) dequantizes a
// tile of weight rows and hands it to at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;

struct QView {
  const uint8_t* codes;
  const c10::Half* scales;
  const c10::Half* mins;  // null: no offset (8-bit)
  int64_t n, k, blocks, row_bytes;
  bool four_bit;
};

QView view_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "qlinear: codes must be a contiguous 2-D tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar,
              "qlinear: codes must be uint8 (4-bit packed) or int8 (8-bit), got ", codes.scalar_type());
  const bool four_bit = codes.scalar_type() == at::kByte;
  const int64_t n = codes.size(0);
  const int64_t k = four_bit ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK(k % kBlock == 0, "qlinear: in_features ", k, " is not a multiple of the block size 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / kBlock,
              "qlinear: scales must be contiguous float16 [", n, ", ", k / kBlock, "], got ", scales.sizes(),
              " ", scales.scalar_type());
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(four_bit == has_mins, "qlinear: 4-bit codes need mins and 8-bit codes take none");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "qlinear: mins must be contiguous float16 shaped like scales");
  }
  return QView{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<c10::Half>(),
               has_mins ? mins->data_ptr<c10::Half>() : nullptr, n, k, k / kBlock, codes.size(1), four_bit};
}

// Dequantize weight rows [row0, row1) into dst (fp32, row-major, leading dimension k).
void dequantize_rows(const QView& w, int64_t row0, int64_t row1, float* dst) {
  for (int64_t r = row0; r < row1; ++r) {
    const uint8_t* q = w.codes + r * w.row_bytes;
    float* out = dst + (r - row0) * w.k;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float d = static_cast<float>(w.scales[r * w.blocks + b]);
      const float m = w.mins ? static_cast<float>(w.mins[r * w.blocks + b]) : 0.0f;
      float* o = out + b * kBlock;
      if (w.four_bit) {
        const uint8_t* qb = q + b * (kBlock / 2);
        for (int j = 0; j < 16; ++j) {
          o[j] = std::fma(d, static_cast<float>(qb[j] & 0x0F), m);
          o[j + 16] = std::fma(d, static_cast<float>(qb[j] >> 4), m);
        }
      } else {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * kBlock;
        for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(qb[j]);
      }
    }
  }
}

#if defined(__AVX512F__)
// Scales (and mins) of up to 16 consecutive blocks of one row, widened to fp32 with one vcvtph2ps:
// converting them one at a time costs more instructions than the block's whole dot product.
struct BlockParams {
  alignas(64) float d[16];
  alignas(64) float m[16];
  void load(const QView& w, int64_t r, int64_t b0, int count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const int64_t at = r * w.blocks + b0;
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scales + at)));
    if (w.mins) _mm512_store_ps(m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.mins + at)));
  }
};

// Block b of a row, dequantized into two registers (elements 0-15, 16-31): fma(d, q, m) is exactly
// the fp32 value gguf dequantizes to.  (Picking each code's value from a 16-entry d*i+m table with
// vpermps measured no faster: bench/quant_kernels.py.)
inline void load_block(const QView& w, const uint8_t* q, int64_t b, float d, float m, __m512& lo, __m512& hi) {
  if (w.four_bit) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    lo = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))), vm);
    hi = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))), vm);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m512 vd = _mm512_set1_ps(d);
    lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))));
    hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))));
  }
}

// out[i, r + n] for rows i < MT of x and NR weight rows from r, together: the x loads are shared
// by NR rows and NR streams of codes are in flight.  Each output keeps separate accumulators for
// a block's two halves, so no block waits on two dependent fmas.
template <int MT, int NR>
inline void dot_tile(const QView& w, int64_t r, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m512 accl[MT][NR], acch[MT][NR];
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) accl[i][n] = acch[i][n] = _mm512_setzero_ps();
  const uint8_t* q[NR];
  for (int n = 0; n < NR; ++n) q[n] = w.codes + (r + n) * w.row_bytes;
  const int64_t block_bytes = w.row_bytes / w.blocks;
  BlockParams p[NR];
  for (int64_t g = 0; g < w.blocks; g += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, w.blocks - g));
    for (int n = 0; n < NR; ++n) p[n].load(w, r + n, g, count);
    // The next rows stream after these: ask for them ahead of the hardware prefetcher, which on its
    // own left one core reading codes at about half the cached rate.
    for (int n = 0; n < NR; ++n) {
      const uint8_t* ahead = q[n] + NR * w.row_bytes + g * block_bytes;
      for (int64_t off = 0; off < block_bytes * count; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    }
    for (int j = 0; j < count; ++j) {
      const int64_t b = g + j;
      __m512 lo[NR], hi[NR];
      for (int n = 0; n < NR; ++n) load_block(w, q[n], b, p[n].d[j], p[n].m[j], lo[n], hi[n]);
      for (int i = 0; i < MT; ++i) {
        const float* xi = x + i * ldx + b * kBlock;
        const __m512 xl = _mm512_loadu_ps(xi), xh = _mm512_loadu_ps(xi + 16);
        for (int n = 0; n < NR; ++n) {
          accl[i][n] = _mm512_fmadd_ps(xl, lo[n], accl[i][n]);
          acch[i][n] = _mm512_fmadd_ps(xh, hi[n], acch[i][n]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int n = 0; n < NR; ++n) out[i * ldo + r + n] = _mm512_reduce_add_ps(_mm512_add_ps(accl[i][n], acch[i][n]));
}

// Weight rows per tile for MT activation rows: as many as the 32 vector registers hold.
template <int MT>
constexpr int kTileRows = MT >= 4 ? 2 : 4;

template <int MT>
void rows_tile(const QView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, const float* /*xs*/,
               int64_t /*ldxs*/, float* out, int64_t ldo) {
  constexpr int NR = kTileRows<MT>;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) dot_tile<MT, NR>(w, r, x, ldx, out, ldo);
  for (; r < r1; ++r) dot_tile<MT, 1>(w, r, x, ldx, out, ldo);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The streaming kernel on 256-bit registers (AVX2 machines without AVX-512: Zen 2/3, Intel
// clients): a block is four registers, one weight row a tile (16 registers leave no room for
// two).  Without it such a machine took the scalar loop below: 7x slower at one row and 16x at 8.
// Converting the codes to float is most of a block's work here, so each code is converted once
// and multiplied once (by x): the scale multiplies the block's dot product and the offset the
// block's input sum, not every lane (faster at every M; `graphexec-bench quant_kernels`, docs/STATUS.md).
struct BlockParams {
  alignas(32) float d[8];
  alignas(32) float m[8];
  void load(const QView& w, int64_t r, int64_t b0, int count) {
    const int64_t at = r * w.blocks + b0;
    const bool whole = at + 8 <= w.n * w.blocks;  // eight values readable (a row's tail reads the next row's)
    _mm256_store_ps(d, halves(w.scales + at, count, whole));
    if (w.mins) _mm256_store_ps(m, halves(w.mins + at, count, whole));
  }
  // Eight fp16 values as floats, zero past `count`: one load wherever eight are readable.  A
  // variable-length memcpy is a library call, several a row: it cost a third of the one-row time
  // (`graphexec-bench quant_kernels`, docs/STATUS.md).
  static __m256 halves(const c10::Half* src, int count, bool whole) {
    __m128i raw;
    if (whole) {
      raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      if (count < 8) raw = _mm_and_si128(raw, _mm_cmpgt_epi16(_mm_set1_epi16(count), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7)));
    } else {
      alignas(16) c10::Half half[8] = {};
      std::memcpy(half, src, count * sizeof(c10::Half));
      raw = _mm_load_si128(reinterpret_cast<const __m128i*>(half));
    }
    return _mm256_cvtph_ps(raw);
  }
};

// Block b of a row's codes as floats, v[0..3] = elements 0-7, 8-15, 16-23, 24-31.
inline void load_codes(const QView& w, const uint8_t* q, int64_t b, __m256 v[4]) {
  if (w.four_bit) {
    // The block's 16 bytes in both 128-bit lanes; in-lane byte shuffles put bytes 0-7 (8-15) one
    // per 32-bit lane, zero-extended, so a mask gives the low nibbles and a shift the high ones
    // (vpmovzxbd crosses lanes: slower).
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2))));
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));  // bytes 8-15
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i b0 = _mm256_shuffle_epi8(raw, first), b1 = _mm256_shuffle_epi8(raw, second);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  } else {
    const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * kBlock;
    for (int h = 0; h < 4; ++h)
      v[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * h))));
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// sum_j x_j (d q_j + m) = d sum_j x_j q_j + m sum_j x_j: per block one fma by d on the codes'
// dot product and, per 8 blocks, one fma of the offsets with the inputs' block sums (`xs`, made
// once per call by `block_sums`), instead of dequantizing every lane first.
template <int MT>
inline void dot_row(const QView& w, int64_t r, const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                    float* out, int64_t ldo) {
  __m256 acc[MT], offsets[MT];
  for (int i = 0; i < MT; ++i) acc[i] = offsets[i] = _mm256_setzero_ps();
  const uint8_t* q = w.codes + r * w.row_bytes;
  const int64_t block_bytes = w.row_bytes / w.blocks;
  BlockParams p;
  for (int64_t g = 0; g < w.blocks; g += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, w.blocks - g));
    p.load(w, r, g, count);
    const uint8_t* ahead = q + w.row_bytes + g * block_bytes;  // the next row, as the AVX-512 path
    for (int64_t off = 0; off < block_bytes * count; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    if (w.mins)  // p.m is zero past `count`, and so is xs (padded to whole groups of 8)
      for (int i = 0; i < MT; ++i) offsets[i] = _mm256_fmadd_ps(_mm256_load_ps(p.m), _mm256_loadu_ps(xs + i * ldxs + g), offsets[i]);
    for (int j = 0; j < count; ++j) {
      const int64_t b = g + j;
      __m256 v[4];
      load_codes(w, q, b, v);
      const __m256 vd = _mm256_set1_ps(p.d[j]);
      for (int i = 0; i < MT; ++i) {
        const float* xi = x + i * ldx + b * kBlock;
        const __m256 even = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 16), v[2], _mm256_mul_ps(_mm256_loadu_ps(xi), v[0]));
        const __m256 odd = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 24), v[3], _mm256_mul_ps(_mm256_loadu_ps(xi + 8), v[1]));
        acc[i] = _mm256_fmadd_ps(vd, _mm256_add_ps(even, odd), acc[i]);
      }
    }
  }
  for (int i = 0; i < MT; ++i) out[i * ldo + r] = hsum(_mm256_add_ps(acc[i], offsets[i]));
}

template <int MT>
void rows_tile(const QView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, const float* xs, int64_t ldxs,
               float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; ++r) dot_row<MT>(w, r, x, ldx, xs, ldxs, out, ldo);
}
#else
// Portable path: dequantize a few rows at a time and dot them (the compiler vectorizes the loops).
template <int MT>
void rows_tile(const QView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, const float* /*xs*/,
               int64_t /*ldxs*/, float* out, int64_t ldo) {
  std::vector<float> row(w.k);
  for (int64_t r = r0; r < r1; ++r) {
    dequantize_rows(w, r, r + 1, row.data());
    for (int i = 0; i < MT; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < w.k; ++j) acc += x[i * ldx + j] * row[j];
      out[i * ldo + r] = acc;
    }
  }
}
#endif

constexpr int64_t kRowChunk = 16;  // weight rows per task: a few KB of codes, reused across M tiles

// Each activation row's per-block input sums, in rows of `stride` (the blocks rounded up to 8,
// zero past the last), for kernels that apply a block's offset once (the AVX2 path); empty where
// the kernel dequantizes every lane.
std::vector<float> block_sums(const QView& w, const float* x, int64_t m, int64_t stride) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // rows_tile's AVX2 branch
  std::vector<float> sums(m * stride, 0.0f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float* xb = x + i * w.k + b * kBlock;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      sums[i * stride + b] = hsum(s);
    }
  return sums;
#else
  (void)w, (void)x, (void)m, (void)stride;
  return {};
#endif
}

void small_m(const QView& w, const float* x, int64_t m, float* out) {
  const int64_t stride = (w.blocks + 7) / 8 * 8;
  const std::vector<float> sums = block_sums(w, x, m, stride);
  at::parallel_for(0, (w.n + kRowChunk - 1) / kRowChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t r0 = c0 * kRowChunk, r1 = std::min(w.n, c1 * kRowChunk);
    for (int64_t rs = r0; rs < r1; rs += kRowChunk) {
      const int64_t re = std::min(r1, rs + kRowChunk);
      int64_t i = 0;
      auto xs = [&](int64_t row) { return sums.empty() ? nullptr : sums.data() + row * stride; };
      for (; i + 4 <= m; i += 4) rows_tile<4>(w, rs, re, x + i * w.k, w.k, xs(i), stride, out + i * w.n, w.n);
      for (; i + 2 <= m; i += 2) rows_tile<2>(w, rs, re, x + i * w.k, w.k, xs(i), stride, out + i * w.n, w.n);
      for (; i < m; ++i) rows_tile<1>(w, rs, re, x + i * w.k, w.k, xs(i), stride, out + i * w.n, w.n);
    }
  });
}

// Dequantized tiles of this many weight rows feed at::mm: a tile stays in L2 (256 x 1536 fp32 = 1.5 MB
// at most for SmolLM2) instead of materializing a whole fp32 weight.
constexpr int64_t kMmTile = 256;

at::Tensor dequantize_tile(const QView& w, int64_t r0, int64_t r1, at::ScalarType dtype) {
  at::Tensor tile = at::empty({r1 - r0, w.k}, at::TensorOptions().dtype(at::kFloat));
  float* dst = tile.data_ptr<float>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequantize_rows(w, a, b, dst + (a - r0) * w.k); });
  return dtype == at::kFloat ? tile : tile.to(dtype);
}

at::Tensor large_m(const QView& w, const at::Tensor& x2d) {
  at::Tensor out = at::empty({x2d.size(0), w.n}, x2d.options());
  for (int64_t r0 = 0; r0 < w.n; r0 += kMmTile) {
    const int64_t r1 = std::min(w.n, r0 + kMmTile);
    at::Tensor part = at::mm(x2d, dequantize_tile(w, r0, r1, x2d.scalar_type()).t());
    out.narrow(1, r0, r1 - r0).copy_(part);
  }
  return out;
}

// Activation rows from which bf16/fp16 inputs take the dequantize-tile + at::mm path, on CPUs that
// multiply that type natively (AVX512-BF16 GEMM beats streaming blocks through fp32 FMAs there).
// Elsewhere at::mm widens the type through fp32 and the tile path lost to streaming at every M
// (measured on an AVX2 Zen 3: docs/STATUS.md).  fp32 inputs always stream: the block kernel
// already runs at the FMA units' peak from 8 rows up.  Measured by bench/quant_kernels.py.
constexpr int64_t kMmMinRowsHalf = 48;

bool native_gemm(at::ScalarType dtype) {
  static const auto caps = at::cpu::get_cpu_capabilities();  // the running CPU's, not the builder's
  auto has = [](const char* name) {
    const auto it = caps.find(name);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  static const bool bf16 = has("avx512_bf16") || has("amx_bf16");
  static const bool fp16 = has("avx512_fp16") || has("amx_fp16");
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf && fp16;
}

at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins) {
  const QView w = view_of(codes, scales, mins);
  TORCH_CHECK(x.size(-1) == w.k, "qlinear: input has ", x.size(-1), " features, the weight takes ", w.k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qlinear: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = w.n;
  const at::Tensor x2d = x.reshape({-1, w.k}).contiguous();
  const int64_t m = x2d.size(0);
  if (m == 0) return at::empty(out_shape, x.options());
  if (m >= kMmMinRowsHalf && native_gemm(x.scalar_type())) return large_m(w, x2d).view(out_shape);
  const at::Tensor x32 = x2d.to(at::kFloat);
  at::Tensor out = at::empty({m, w.n}, x32.options());
  small_m(w, x32.data_ptr<float>(), m, out.data_ptr<float>());
  return out.to(x.scalar_type()).view(out_shape);
}

at::Tensor qdequantize_cpu(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                           at::ScalarType dtype) {
  const QView w = view_of(codes, scales, mins);
  return dequantize_tile(w, 0, w.n, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(graphexec, CPU, m) {
  m.impl("qlinear", &qlinear_cpu);
  m.impl("qdequantize", &qdequantize_cpu);
}
