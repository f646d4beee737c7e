// GGUF K-quant (Q4_K, Q5_K, Q6_K) and 5-bit (Q5_0, Q5_1) weights on CPU, kept in the file's own
// block bytes: graphexec::qlinear_blocks and graphexec::qdequantize_blocks (schemas are defined in
// Python: graphexec/quant/kquants.py).
//
// Weight layout: uint8 [N, row_bytes], each row the GGUF blocks of one output row, untouched.
// Every block is read as 16-element chunks, each `scale * code + offset` with an integer code and
// two fp32 numbers per chunk (K-quants: d * sub-block scale and dmin * sub-block min, computed
// once per super-block, in fp32 as gguf computes them).  (d * sc) * q is exact in fp32 for every
// type here: an 11-bit fp16 mantissa times a sub-block scale (at most 7 significant bits, Q6_K's
// int8) and a code (at most 5, Q5_K's / Q6_K's) needs at most 23 of fp32's 24 bits.  So one fma
// gives the same single rounding as gguf's `(d * sc) * q - dmin * m`, and the weight equals
// gguf's fp32 dequantization bit for bit (tests/test_kquants.py checks the bit patterns).
//
// Small M (decode rows) streams the blocks once per tile of M rows, decoding each chunk into a
// register; large M (prefill) dequantizes a tile of weight rows and hands it to at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// GGML's type ids, which the Python side passes as they are.
constexpr int64_t kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kChunk = 16;

struct BView {
  const uint8_t* data;
  int64_t qtype, n, k, row_bytes, block_elems, block_bytes, blocks;
};

BView view_of(const at::Tensor& blocks, int64_t qtype, const char* op) {
  int64_t elems = 0, bytes = 0;
  switch (qtype) {
    case kQ5_0: elems = 32, bytes = 22; break;
    case kQ5_1: elems = 32, bytes = 24; break;
    case kQ4_K: elems = 256, bytes = 144; break;
    case kQ5_K: elems = 256, bytes = 176; break;
    case kQ6_K: elems = 256, bytes = 210; break;
    default:
      TORCH_CHECK(false, op, ": GGUF type id ", qtype, " is not one this kernel reads (Q5_0=6, Q5_1=7, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte, op,
              ": blocks must be a contiguous uint8 [rows, row_bytes] tensor, got ", blocks.sizes(), " ", blocks.scalar_type());
  const int64_t row_bytes = blocks.size(1);
  TORCH_CHECK(row_bytes % bytes == 0, op, ": a row of ", row_bytes, " bytes is not whole ", bytes, "-byte blocks of type id ", qtype);
  const int64_t nblocks = row_bytes / bytes;
  return BView{blocks.data_ptr<uint8_t>(), qtype, blocks.size(0), nblocks * elems, row_bytes, elems, bytes, nblocks};
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);  // blocks of 22 or 210 bytes leave fp16 fields unaligned
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's conversion is a bit-twiddling routine
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

template <int64_t QT>
constexpr int kChunks = QT == kQ5_0 || QT == kQ5_1 ? 2 : 16;  // 16-element chunks a block

// Chunks that share one (scale, offset): a K-quant sub-block of 32 (Q4_K, Q5_K) or 16 (Q6_K);
// a whole 32-element block for Q5_x.
template <int64_t QT>
constexpr int kPerParam = QT == kQ6_K ? 1 : 2;

// A block's scales and offsets (value = scale * code + offset), one per kPerParam chunks.
template <int64_t QT>
inline void block_params(const uint8_t* blk, float* scale, float* offset) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    // 8 six-bit scales and 8 six-bit mins in 12 bytes a, b, c (4 each): scales 0-3 and mins 0-3
    // are the low 6 bits of a and b; scales 4-7 are c's low nibbles with a's top 2 bits above
    // them, mins 4-7 c's high nibbles with b's top 2 bits.  Done on 4 bytes at once.
    uint32_t a, b, c;
    std::memcpy(&a, blk + 4, 4), std::memcpy(&b, blk + 8, 4), std::memcpy(&c, blk + 12, 4);
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, m_lo = b & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    const float d = half_at(blk), dmin = half_at(blk + 2);
#if defined(__AVX512F__) || defined(__AVX2__)  // 256-bit instructions: AVX2 has them all
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc_lo))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(m_hi), static_cast<int>(m_lo))));
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), sc));
    // (-dmin) * m is -(dmin * m) exactly (rounding is sign-symmetric), -0.0 included: what gguf subtracts.
    _mm256_storeu_ps(offset, _mm256_mul_ps(_mm256_set1_ps(-dmin), m));
#else
    const uint32_t words[2][2] = {{sc_lo, sc_hi}, {m_lo, m_hi}};
    for (int j = 0; j < 8; ++j) {
      const int sc = (words[0][j / 4] >> (8 * (j % 4))) & 0xFF, m = (words[1][j / 4] >> (8 * (j % 4))) & 0xFF;
      scale[j] = d * static_cast<float>(sc);
      offset[j] = -(dmin * static_cast<float>(m));
    }
#endif
  } else if constexpr (QT == kQ6_K) {
    const float d = half_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
#if defined(__AVX512F__)
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_set1_ps(d), s));
#elif defined(__AVX2__)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))));
    _mm256_storeu_ps(scale + 8, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)))));
#else
    for (int c = 0; c < 16; ++c) scale[c] = d * static_cast<float>(sc[c]);
#endif
  } else {
    scale[0] = half_at(blk);
    offset[0] = QT == kQ5_1 ? half_at(blk + 2) : 0.0f;
  }
}

// Types whose value has no offset multiply instead (keeps gguf's -0.0 where the code is 0).
template <int64_t QT>
constexpr bool kHasOffset = QT == kQ4_K || QT == kQ5_K || QT == kQ5_1;
template <int64_t QT>
constexpr int kBias = QT == kQ6_K ? 32 : (QT == kQ5_0 ? 16 : 0);

// Codes of chunk c (before the bias): the nibble of `lo` at `shift`, plus high bits.
template <int64_t QT>
inline void chunk_layout(const uint8_t* blk, int c, const uint8_t*& lo, int& lo_shift, const uint8_t*& hi, int& hi_shift,
                         uint32_t& hi_mask) {
  hi = nullptr, hi_shift = 0, hi_mask = 0;
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    // Sub-block j = c/2 (32 elements): byte group j/2 of 32 bytes, low nibbles for even j.
    const uint8_t* qs = blk + (QT == kQ4_K ? 16 : 48);
    lo = qs + (c / 4) * 32 + (c & 1) * 16;
    lo_shift = 4 * ((c / 2) & 1);
    if constexpr (QT == kQ5_K) hi = blk + 16 + (c & 1) * 16, hi_shift = c / 2;  // bit j of each byte
  } else if constexpr (QT == kQ6_K) {
    const int h = c / 8, w = c % 8;  // two halves of 128 elements
    lo = blk + h * 64 + (w % 4) * 16;
    lo_shift = 4 * (w / 4);
    hi = blk + 128 + h * 32 + (w % 2) * 16;
    hi_shift = 2 * (w / 2);
  } else {
    uint32_t qh;
    std::memcpy(&qh, blk + (QT == kQ5_1 ? 4 : 2), 4);
    lo = blk + (QT == kQ5_1 ? 8 : 6);
    lo_shift = 4 * c;
    hi_mask = (qh >> (16 * c)) & 0xFFFF;  // bit l: element l of the chunk has code bit 4 set
  }
}

template <int64_t QT>
inline void decode_chunk_scalar(const uint8_t* blk, int c, float scale, float offset, float* out) {
  const uint8_t *lo, *hi;
  int lo_shift, hi_shift;
  uint32_t hi_mask;
  chunk_layout<QT>(blk, c, lo, lo_shift, hi, hi_shift, hi_mask);
  for (int l = 0; l < kChunk; ++l) {
    int q = (lo[l] >> lo_shift) & 0x0F;
    if constexpr (QT == kQ5_K) q |= ((hi[l] >> hi_shift) & 1) << 4;
    if constexpr (QT == kQ6_K) q |= ((hi[l] >> hi_shift) & 3) << 4;
    if constexpr (QT == kQ5_0 || QT == kQ5_1) q |= ((hi_mask >> l) & 1) << 4;
    const float v = static_cast<float>(q - kBias<QT>);
    out[l] = kHasOffset<QT> ? std::fma(scale, v, offset) : scale * v;
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Chunk c's 16 codes as bytes: the low nibbles, with Q5_K/Q6_K's high bits or'ed in; Q5_0/Q5_1's
// fifth bits come back in hi_mask (bit l: element l), for the caller's wider registers.
template <int64_t QT>
inline __m128i chunk_bytes(const uint8_t* blk, int c, uint32_t& hi_mask) {
  const uint8_t *lo, *hi;
  int lo_shift, hi_shift;
  chunk_layout<QT>(blk, c, lo, lo_shift, hi, hi_shift, hi_mask);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i q = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)), _mm_cvtsi32_si128(lo_shift)), low4);
  if constexpr (QT == kQ5_K || QT == kQ6_K) {
    const __m128i bits = _mm_set1_epi8(QT == kQ5_K ? 0x01 : 0x03);
    const __m128i h = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), _mm_cvtsi32_si128(hi_shift)), bits);
    q = _mm_or_si128(q, _mm_slli_epi16(h, 4));  // h <= 3 per byte: nothing crosses into the next byte
  }
  return q;
}
#endif

#if defined(__AVX512F__)
template <int64_t QT>
inline __m512 decode_chunk(const uint8_t* blk, int c, float scale, float offset) {
  uint32_t hi_mask;
  __m512i q32 = _mm512_cvtepu8_epi32(chunk_bytes<QT>(blk, c, hi_mask));
  if constexpr (QT == kQ5_0 || QT == kQ5_1)
    q32 = _mm512_mask_or_epi32(q32, static_cast<__mmask16>(hi_mask), q32, _mm512_set1_epi32(16));
  if constexpr (kBias<QT> != 0) q32 = _mm512_sub_epi32(q32, _mm512_set1_epi32(kBias<QT>));
  const __m512 v = _mm512_cvtepi32_ps(q32);
  if constexpr (kHasOffset<QT>) return _mm512_fmadd_ps(_mm512_set1_ps(scale), v, _mm512_set1_ps(offset));
  return _mm512_mul_ps(_mm512_set1_ps(scale), v);
}
#elif defined(__AVX2__) && defined(__FMA__)
// decode_chunk on 256-bit registers (AVX2 builds): the 16 values of chunk c, elements 0-7 in v[0]
// and 8-15 in v[1], each the same single-rounding fma.
template <int64_t QT>
inline void decode_chunk_avx2(const uint8_t* blk, int c, float scale, float offset, __m256 v[2]) {
  uint32_t hi_mask;
  const __m128i q = chunk_bytes<QT>(blk, c, hi_mask);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int half = 0; half < 2; ++half) {
    __m256i q32 = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(q, 8) : q);
    if constexpr (QT == kQ5_0 || QT == kQ5_1) {
      const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(hi_mask >> (8 * half))), lanes),
                                           _mm256_set1_epi32(1));
      q32 = _mm256_or_si256(q32, _mm256_slli_epi32(bit, 4));
    }
    if constexpr (kBias<QT> != 0) q32 = _mm256_sub_epi32(q32, _mm256_set1_epi32(kBias<QT>));
    const __m256 f = _mm256_cvtepi32_ps(q32);
    v[half] = kHasOffset<QT> ? _mm256_fmadd_ps(_mm256_set1_ps(scale), f, _mm256_set1_ps(offset))
                             : _mm256_mul_ps(_mm256_set1_ps(scale), f);
  }
}
#endif

template <int64_t QT>
void dequantize_rows(const BView& w, int64_t row0, int64_t row1, float* dst) {
  float scale[16], offset[16] = {};  // Q6_K has no offsets
  for (int64_t r = row0; r < row1; ++r) {
    const uint8_t* row = w.data + r * w.row_bytes;
    float* out = dst + (r - row0) * w.k;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* blk = row + b * w.block_bytes;
      block_params<QT>(blk, scale, offset);
      for (int c = 0; c < kChunks<QT>; ++c) {
        float* o = out + b * w.block_elems + c * kChunk;
        const float sc = scale[c / kPerParam<QT>], off = offset[c / kPerParam<QT>];
#if defined(__AVX512F__)
        _mm512_storeu_ps(o, decode_chunk<QT>(blk, c, sc, off));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 v[2];
        decode_chunk_avx2<QT>(blk, c, sc, off, v);
        _mm256_storeu_ps(o, v[0]), _mm256_storeu_ps(o + 8, v[1]);
#else
        decode_chunk_scalar<QT>(blk, c, sc, off, o);
#endif
      }
    }
  }
}

#if defined(__AVX512F__)
// out[i, r + n] for MT rows of x and NR weight rows from r: each chunk is decoded once into a
// register and used by all MT rows, and NR rows stream at once.  Chunks go in pairs with an
// accumulator each; the pair is explicit (an index c & 1 into the accumulators would keep them
// in memory, a store and a load on every fma's critical path).
template <int64_t QT, int MT, int NR>
inline void dot_tile(const BView& w, int64_t r, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int per = kPerParam<QT>;
  float scale[NR][16], offset[NR][16] = {};  // Q6_K has no offsets
  __m512 even[NR][MT], odd[NR][MT];
  for (int n = 0; n < NR; ++n)
    for (int i = 0; i < MT; ++i) even[n][i] = odd[n][i] = _mm512_setzero_ps();
  const uint8_t* rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = w.data + (r + n) * w.row_bytes;
  // The rows after these, requested a block ahead of their decoding: left to the hardware
  // prefetcher, weights read from L3 (a whole model's linears) ran ~3x slower than from L2.
  const char* ahead = reinterpret_cast<const char*>(rows[0] + NR * w.row_bytes);
  const char* end = reinterpret_cast<const char*>(w.data + w.n * w.row_bytes);
  const int64_t ahead_bytes = NR * w.block_bytes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int64_t off = 0; off < ahead_bytes; off += 64)
      if (ahead + off < end) _mm_prefetch(ahead + off, _MM_HINT_T0);
    ahead += ahead_bytes;
    const uint8_t* blk[NR];
    for (int n = 0; n < NR; ++n) blk[n] = rows[n] + b * w.block_bytes, block_params<QT>(blk[n], scale[n], offset[n]);
    const float* xb = x + b * w.block_elems;
#pragma GCC unroll 8
    for (int c = 0; c < kChunks<QT>; c += 2) {
      for (int n = 0; n < NR; ++n) {
        const __m512 v0 = decode_chunk<QT>(blk[n], c, scale[n][c / per], offset[n][c / per]);
        const __m512 v1 = decode_chunk<QT>(blk[n], c + 1, scale[n][(c + 1) / per], offset[n][(c + 1) / per]);
        for (int i = 0; i < MT; ++i) {
          even[n][i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * ldx + c * kChunk), v0, even[n][i]);
          odd[n][i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * ldx + (c + 1) * kChunk), v1, odd[n][i]);
        }
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int i = 0; i < MT; ++i) out[i * ldo + r + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[n][i], odd[n][i]));
}

// Weight rows per tile for MT activation rows: with fewer activation rows, more weight rows.
template <int MT>
constexpr int kTileRows = MT >= 8 ? 1 : (MT == 4 ? 2 : 4);

template <int64_t QT, int MT>
void rows_tile(const BView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int NR = kTileRows<MT>;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) dot_tile<QT, MT, NR>(w, r, x, ldx, out, ldo);
  for (; r < r1; ++r) dot_tile<QT, MT, 1>(w, r, x, ldx, out, ldo);
}
#else
// x . row over 16 running sums: a float reduction the compiler may not reorder, written so it need
// not (one accumulator lane per element mod 16 vectorizes per step).  A single running sum kept
// the loop scalar: when AVX2 builds still took this path, a forward's K-quant linears took 71 ms
// at one row (`GRAPHEXEC_KERNEL_ISA=avx2 graphexec-bench quant_kernels --kquant`).
inline float dot_lanes(const float* x, const float* row, int64_t k) {
  float acc[16] = {};
  int64_t j = 0;
  for (; j + 16 <= k; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[j + l] * row[j + l];
  for (; j < k; ++j) acc[j % 16] += x[j] * row[j];
  float total = 0.0f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  return total;
}

// Portable path: dequantize one row at a time and dot it with MT rows.
template <int64_t QT, int MT>
void dequantized_rows_tile(const BView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out, int64_t ldo) {
  thread_local std::vector<float> row;
  if (static_cast<int64_t>(row.size()) < w.k) row.resize(w.k);
  for (int64_t r = r0; r < r1; ++r) {
    dequantize_rows<QT>(w, r, r + 1, row.data());
    for (int i = 0; i < MT; ++i) out[i * ldo + r] = dot_lanes(x + i * ldx, row.data(), w.k);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// AVX2, up to 4 activation rows: each chunk decoded into two registers and multiplied straight
// into the rows' sums, one accumulator per half (independent fma chains), instead of storing a
// dequantized row and reading it back (`graphexec-bench quant_kernels --kquant`, docs/STATUS.md).
// More rows than 4 would need more registers than AVX2 has: they go four at a time, each four
// decoding the chunks again (still faster than a stored row at 8 and 16 rows).
template <int64_t QT, int MT>
void rows_tile(const BView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out, int64_t ldo) {
  if constexpr (MT > 4) {
    rows_tile<QT, 4>(w, r0, r1, x, ldx, out, ldo);
    rows_tile<QT, MT - 4>(w, r0, r1, x + 4 * ldx, ldx, out + 4 * ldo, ldo);
  } else {
    constexpr int per = kPerParam<QT>;
    float scale[16], offset[16] = {};  // Q6_K has no offsets
    for (int64_t r = r0; r < r1; ++r) {
      __m256 lo[MT], hi[MT];
      for (int i = 0; i < MT; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
      const uint8_t* row = w.data + r * w.row_bytes;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* blk = row + b * w.block_bytes;
        block_params<QT>(blk, scale, offset);
        const float* xb = x + b * w.block_elems;
        for (int c = 0; c < kChunks<QT>; ++c) {
          __m256 v[2];
          decode_chunk_avx2<QT>(blk, c, scale[c / per], offset[c / per], v);
          for (int i = 0; i < MT; ++i) {
            lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * ldx + c * kChunk), v[0], lo[i]);
            hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * ldx + c * kChunk + 8), v[1], hi[i]);
          }
        }
      }
      for (int i = 0; i < MT; ++i) out[i * ldo + r] = hsum(_mm256_add_ps(lo[i], hi[i]));
    }
  }
}
#else
template <int64_t QT, int MT>
void rows_tile(const BView& w, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out, int64_t ldo) {
  dequantized_rows_tile<QT, MT>(w, r0, r1, x, ldx, out, ldo);
}
#endif
#endif

constexpr int64_t kRowChunk = 16;  // weight rows per task: a few KB of blocks, reused across M tiles

template <int64_t QT>
void small_m(const BView& w, const float* x, int64_t m, float* out) {
  at::parallel_for(0, (w.n + kRowChunk - 1) / kRowChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t r0 = c0 * kRowChunk, r1 = std::min(w.n, c1 * kRowChunk);
    for (int64_t rs = r0; rs < r1; rs += kRowChunk) {
      const int64_t re = std::min(r1, rs + kRowChunk);
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) rows_tile<QT, 8>(w, rs, re, x + i * w.k, w.k, out + i * w.n, w.n);
      for (; i + 4 <= m; i += 4) rows_tile<QT, 4>(w, rs, re, x + i * w.k, w.k, out + i * w.n, w.n);
      for (; i + 2 <= m; i += 2) rows_tile<QT, 2>(w, rs, re, x + i * w.k, w.k, out + i * w.n, w.n);
      for (; i < m; ++i) rows_tile<QT, 1>(w, rs, re, x + i * w.k, w.k, out + i * w.n, w.n);
    }
  });
}

template <typename F>
void by_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    default: f(std::integral_constant<int64_t, kQ6_K>{}); break;  // view_of admitted only these five
  }
}

// Dequantized tiles of this many weight rows feed at::mm: a tile stays in L2 instead of
// materializing the whole fp32 weight.
constexpr int64_t kMmTile = 256;

at::Tensor dequantize_tile(const BView& w, int64_t r0, int64_t r1) {
  at::Tensor tile = at::empty({r1 - r0, w.k}, at::TensorOptions().dtype(at::kFloat));
  float* dst = tile.data_ptr<float>();
  by_type(w.qtype, [&](auto qt) {
    at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequantize_rows<decltype(qt)::value>(w, a, b, dst + (a - r0) * w.k); });
  });
  return tile;
}

// From this many activation rows a dequantized tile and at::mm beat decoding each chunk once per
// tile of 8 rows (the GEMM reuses a weight element across many more rows).  Measured on one
// AVX-512 core (Q4_K / Q6_K at K=1536, Q5_1 at K=576): streaming wins at 16 rows, the tile at 32.
constexpr int64_t kMmMinRows = 24;

at::Tensor qlinear_blocks_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  const BView w = view_of(blocks, qtype, "qlinear_blocks");
  TORCH_CHECK(x.size(-1) == w.k, "qlinear_blocks: input has ", x.size(-1), " features, the weight takes ", w.k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qlinear_blocks: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = w.n;
  const at::Tensor x32 = x.reshape({-1, w.k}).to(at::kFloat).contiguous();
  const int64_t m = x32.size(0);
  if (m == 0) return at::empty(out_shape, x.options());
  at::Tensor out = at::empty({m, w.n}, x32.options());
  if (m >= kMmMinRows) {
    for (int64_t r0 = 0; r0 < w.n; r0 += kMmTile) {
      const int64_t r1 = std::min(w.n, r0 + kMmTile);
      out.narrow(1, r0, r1 - r0).copy_(at::mm(x32, dequantize_tile(w, r0, r1).t()));
    }
  } else {
    by_type(w.qtype, [&](auto qt) { small_m<decltype(qt)::value>(w, x32.data_ptr<float>(), m, out.data_ptr<float>()); });
  }
  return out.to(x.scalar_type()).view(out_shape);
}

at::Tensor qdequantize_blocks_cpu(const at::Tensor& blocks, int64_t qtype, at::ScalarType dtype) {
  const BView w = view_of(blocks, qtype, "qdequantize_blocks");
  const at::Tensor tile = dequantize_tile(w, 0, w.n);
  return dtype == at::kFloat ? tile : tile.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(graphexec, CPU, m) {
  m.impl("qlinear_blocks", &qlinear_blocks_cpu);
  m.impl("qdequantize_blocks", &qdequantize_blocks_cpu);
}
