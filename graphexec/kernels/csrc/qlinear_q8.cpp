// Block-quantized linear with 8-bit activations, for graphexec::qlinear_q8 (schema in
// graphexec/quant/ops.py; `model.activations=q8`).
//
// Each call quantizes its activation rows once, per 32-element block: d = max|x| / 127, q =
// round-half-even(x * 127 / max|x|), and s = d * sum(q).  A block's dot product is then integer:
//   sum_j (dw*qw_j + mw) * (dx*qx_j) = dw*dx * sum_j qw_j*qx_j + mw * s
// so a block costs byte dot products and one scale fma, not 32 dequantizing fmas, and reads a
// quarter of the activation bytes.  8-bit weights take the same form with their codes offset to
// unsigned (qw + 128, mw = -128 dw) where the dot instruction wants unsigned bytes, or llama.cpp's
// sign trick where 16-bit pair sums could overflow.
//
// Weight layout: rows interleaved in groups of 16 (graphexec/quant/repack.py packs it at load),
// so one 512-bit register holds 4 consecutive codes of 16 output rows, one per 32-bit lane:
//   codes  [G, B, J, 16, 4]: codes[g, b, j, r, :] are row 16g+r's block-b bytes 4j..4j+3
//          4-bit (uint8, J = 4): byte t holds element 4j+t (low nibble) and 16+4j+t (high);
//          5-bit (uint8, J = 5): the 4-bit layout's low nibbles, then 64 bytes of fifth bits: eight
//            little-endian 64-bit masks, mask v's bit 4r+t the fifth bit of the code in lane r,
//            byte t of the v-th 4-bit register below (so one masked add sets a register's bits);
//          6-bit (uint8, J = 6): the same with a second plane (sixth bits); codes 0..63 stand for
//            q - 32 (Q6_K), so the kind takes no mins: its offset is -32 d, as 8-bit's is -128 d
//          8-bit (int8, J = 8): element 4j+t
//   scales, mins [G, B, 16]: row 16g+r's block-b d and m (4-, 5-bit: value = d*q + m), float16
//          as Q4_x/Q8_0/Q5_x files hold them, or float32 where a K-quant's d times a sub-block's
//          integer scale needs more bits; [G, B, 2, 16] float32: one d per 16-element half (Q6_K),
//          each half then its own integer sum (and its own activation sum for the offset term)
// A block of 16 rows is then 8 dot-product instructions against broadcast activation bytes, whose
// 16 lanes are the 16 rows' integer block sums: one convert and one fma scale all 16, and nothing
// is reduced across lanes.  (ik_llama.cpp's _R4/_R8 types and llama.cpp's Q4_0_8_8 interleave
// rows for the same reason.)  Rows past `n` in the last group are zero padding and not written.
//
// Paths, by what the build's flags allow (graphexec/kernels/__init__.py ISA_FLAGS):
//   AVX512-VNNI  vpdpbusd, 16 rows per instruction
//   AVX512BW     vpmaddubsw + vpmaddwd, 16 rows
//   AVX-VNNI     vpdpbusd (VEX), 8 rows
//   AVX2         vpmaddubsw + vpmaddwd, 8 rows
//   portable     scalar integer loops
// Every path quantizes identically and sums the same integers; only the float accumulation order
// of the block terms may differ.  (tests/test_quant_q8.py; tests/test_kernel_isa.py across paths.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;  // rows interleaved
// A group's codes are one contiguous stream; asking for them this far ahead of the hardware
// prefetcher made a forward's linears 1.3x faster at 1 row and 1.4x at 8 (2 threads; 1024-16384
// bytes measured, `graphexec-bench quant_kernels`).  Past the end it only hints at unmapped memory,
// which a prefetch never faults on.
constexpr int64_t kPrefetchBytes = 4096;

// The code kinds: 4-bit unsigned (two a byte; Q4_0/Q4_1/Q4_K), 5-bit unsigned (Q5_0/Q5_1/Q5_K:
// 4-bit plus a plane of fifth bits), 6-bit offset by 32 (Q6_K: 4-bit plus two planes) and 8-bit
// signed (Q8_0).  U4 and U5 carry mins (value = d*q + m); U6 and S8 are signed (value = d*q).
enum class Kind { U4, U5, U6, S8 };

// Kinds whose low four bits come two a byte.
template <Kind K>
constexpr bool kNibbles = K != Kind::S8;

// Bit planes above the nibbles.
template <Kind K>
constexpr int kPlanes = K == Kind::U5 ? 1 : K == Kind::U6 ? 2 : 0;

template <Kind K>
constexpr int kJ = kNibbles<K> ? 4 + kPlanes<K> : 8;

// Kinds with mins (value = d*q + m); the others' unsigned forms subtract kBias<K> * d.
template <Kind K>
constexpr bool kHasMins = K == Kind::U4 || K == Kind::U5;

template <Kind K>
constexpr float kBias = K == Kind::U6 ? 32.0f : 128.0f;

constexpr int64_t kNibbleBytes = 4 * kGroup * 4;  // a block's low nibbles: where the bit planes start

// Mask v of bit plane `plane` (the block's fifth bits, then its sixth).
inline uint64_t plane_bits(const uint8_t* block, int plane, int v) {
  uint64_t bits;
  std::memcpy(&bits, block + kNibbleBytes + 64 * plane + 8 * v, 8);
  return bits;
}

struct RView {
  const uint8_t* codes;
  const void* scales;  // c10::Half or float, as `fp32` says
  const void* mins;    // null: the kinds without mins (U6, S8)
  int64_t n, k, groups, blocks, group_bytes;
  Kind kind;
  bool fp32;    // float32 scales and mins (K-quants), else float16
  bool halves;  // a scale per 16-element half block (Q6_K): [G, B, 2, 16]
};

RView view_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t n) {
  TORCH_CHECK(codes.dim() == 5 && codes.is_contiguous() && codes.size(3) == kGroup && codes.size(4) == 4,
              "qlinear_q8: codes must be contiguous [groups, blocks, J, 16, 4] (graphexec/quant/repack.py), got ",
              codes.sizes());
  const bool is_signed = codes.scalar_type() == at::kChar;
  const int64_t J = codes.size(2);
  TORCH_CHECK((codes.scalar_type() == at::kByte && J >= 4 && J <= 6) || (is_signed && J == 8),
              "qlinear_q8: codes must be uint8 with J = 4, 5 or 6 (4-, 5-, 6-bit), or int8 with J = 8; got ",
              codes.scalar_type(), " with J = ", J);
  const Kind kind = is_signed ? Kind::S8 : J == 4 ? Kind::U4 : J == 5 ? Kind::U5 : Kind::U6;
  const int64_t groups = codes.size(0), blocks = codes.size(1);
  TORCH_CHECK(n > (groups - 1) * kGroup && n <= groups * kGroup, "qlinear_q8: ", n, " output rows do not fill ", groups,
              " groups of 16");
  const bool fp32 = scales.scalar_type() == at::kFloat, halves = scales.dim() == 4;
  TORCH_CHECK((fp32 || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              "qlinear_q8: scales must be contiguous float16 or float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({groups, blocks, kGroup}) ||
                  (fp32 && scales.sizes() == at::IntArrayRef({groups, blocks, 2, kGroup})),
              "qlinear_q8: scales must be [", groups, ", ", blocks, ", 16] (or float32 [", groups, ", ", blocks,
              ", 2, 16], one per half block), got ", scales.sizes());
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK((kind == Kind::U4 || kind == Kind::U5) == has_mins,
              "qlinear_q8: 4- and 5-bit codes need mins; 6-bit (offset) and 8-bit (signed) codes take none");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "qlinear_q8: mins must be contiguous, shaped and typed like scales");
  }
  return RView{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
               has_mins ? mins->data_ptr() : nullptr, n, blocks * kBlock, groups, blocks,
               blocks * codes.size(2) * kGroup * 4, kind, fp32, halves};
}

// Quantized activation rows, each block in natural order; s per block and per half block.
struct Q8Rows {
  int64_t m, blocks;
  std::vector<int8_t> q;
  std::vector<float> d, s, s2;

  Q8Rows(int64_t rows, int64_t nblocks)
      : m(rows), blocks(nblocks), q(rows * nblocks * kBlock), d(rows * nblocks), s(rows * nblocks), s2(rows * nblocks * 2) {}

  const int8_t* q_row(int64_t i) const { return q.data() + i * blocks * kBlock; }
  const float* d_row(int64_t i) const { return d.data() + i * blocks; }
  const float* s_row(int64_t i) const { return s.data() + i * blocks; }
  const float* s2_row(int64_t i) const { return s2.data() + i * blocks * 2; }
};

void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* s, float* s2) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
#if defined(GX_Q8_ZMM)
    // The same arithmetic as the scalar loop below (max and products are exact; the convert rounds
    // half to even like nearbyint), so every path gets the same codes.
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const __m512 inverse = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    const int sums[2] = {_mm512_reduce_add_epi32(qlo), _mm512_reduce_add_epi32(qhi)};
#else
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sums[2] = {0, 0};
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sums[j / 16] += v;
    }
#endif
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(sums[0] + sums[1]);
    s2[2 * b] = d[b] * static_cast<float>(sums[0]);
    s2[2 * b + 1] = d[b] * static_cast<float>(sums[1]);
  }
}

Q8Rows quantize(const float* x, int64_t m, int64_t k) {
  Q8Rows rows(m, k / kBlock);
  // A few rows are microseconds of work: no parallel region for decode.
  at::parallel_for(0, m, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      quantize_row(x + i * k, rows.blocks, rows.q.data() + i * k, rows.d.data() + i * rows.blocks,
                   rows.s.data() + i * rows.blocks, rows.s2.data() + i * rows.blocks * 2);
    }
  });
  return rows;
}

// Whether the block offsets mw * s enter the sum: unsigned codes always (their mins, or U6's
// -32 d), signed 8-bit codes only when offset to unsigned for the VNNI instruction.
template <Kind K>
constexpr bool kHasOffset =
#if defined(GX_Q8_VNNI)
    true;
#else
    K != Kind::S8;
#endif

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(GX_Q8_ZMM)
// z + the 16 lanes' dot products of 4 weight bytes with the same 4 activation bytes.
template <Kind K>
inline __m512i dot4(__m512i z, __m512i w, int32_t x4) {
  const __m512i x = _mm512_set1_epi32(x4);
#if defined(GX_Q8_VNNI)
  return _mm512_dpbusd_epi32(z, w, x);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (K != Kind::S8) return _mm512_add_epi32(z, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  // |w| times x with w's sign: the pair sums stay within int16 (2 * 128 * 127).
  const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_add_epi32(z, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x), ones));
#endif
}

inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// out[i0 + i, 16g .. 16g + 16) for MT activation rows; S is the scales' type, H the scales a
// block (2: per half).
template <Kind K, typename S, int H, int MT>
void group_tile(const RView& w, int64_t g, const Q8Rows& a, int64_t i0, float* out) {
  constexpr int J = kJ<K>;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + g * w.group_bytes;
  const S* scales = static_cast<const S*>(w.scales) + g * w.blocks * H * kGroup;
  const S* mins = w.mins ? static_cast<const S*>(w.mins) + g * w.blocks * H * kGroup : nullptr;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* cb = codes + b * J * 64;
    for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetchBytes + j * 64), _MM_HINT_T0);
    __m512 dw[H], mw[H];
    for (int h = 0; h < H; ++h) {
      dw[h] = load16(scales + (b * H + h) * kGroup);
      mw[h] = _mm512_setzero_ps();
      if constexpr (kHasMins<K>) mw[h] = load16(mins + (b * H + h) * kGroup);
      else if constexpr (kHasOffset<K>) mw[h] = _mm512_mul_ps(dw[h], _mm512_set1_ps(-kBias<K>));
    }
    // Element order of wv[]: 4-bit wv[2j] = elements 4j.., wv[2j+1] = 16+4j..; 8-bit wv[j] = 4j..
    __m512i wv[8];
    if constexpr (kNibbles<K>) {
      const __m512i mask = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(cb + j * 64);
        wv[2 * j] = _mm512_and_si512(raw, mask);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
      for (int plane = 0; plane < kPlanes<K>; ++plane) {
        const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << plane));
        for (int v = 0; v < 8; ++v) wv[v] = _mm512_mask_add_epi8(wv[v], _cvtu64_mask64(plane_bits(cb, plane, v)), wv[v], bit);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        wv[j] = _mm512_loadu_si512(cb + j * 64);
#if defined(GX_Q8_VNNI)
        if constexpr (K == Kind::S8) wv[j] = _mm512_xor_si512(wv[j], _mm512_set1_epi8(static_cast<char>(0x80)));
#endif
      }
    }
    for (int i = 0; i < MT; ++i) {
      const int8_t* xb = a.q_row(i0 + i) + b * kBlock;
      __m512i z[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // elements 0..15, 16..31
      for (int j = 0; j < 4; ++j) {
        z[0] = dot4<K>(z[0], wv[kNibbles<K> ? 2 * j : j], load_i32(xb + 4 * j));
        z[1] = dot4<K>(z[1], wv[kNibbles<K> ? 2 * j + 1 : j + 4], load_i32(xb + 16 + 4 * j));
      }
      const __m512 dx = _mm512_set1_ps(a.d_row(i0 + i)[b]);
      if constexpr (H == 1) z[0] = _mm512_add_epi32(z[0], z[1]);
      for (int h = 0; h < H; ++h) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z[h]), _mm512_mul_ps(dw[h], dx), acc[i]);
        const float sx = H == 1 ? a.s_row(i0 + i)[b] : a.s2_row(i0 + i)[2 * b + h];
        if constexpr (kHasOffset<K>) acc[i] = _mm512_fmadd_ps(mw[h], _mm512_set1_ps(sx), acc[i]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kGroup, w.n - g * kGroup);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(out + (i0 + i) * w.n + g * kGroup, keep, acc[i]);
}

#elif defined(GX_Q8_YMM)
// The 16 rows of a group as two halves of 8 lanes.
template <Kind K>
inline __m256i dot4(__m256i z, __m256i w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
#if defined(GX_Q8_VNNI)
  return _mm256_dpbusd_avx_epi32(z, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (K != Kind::S8) return _mm256_add_epi32(z, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  return _mm256_add_epi32(z, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones));
#endif
}

// 0xFF in byte i where bit i of `bits` is set (llama.cpp's bytes_from_bits_32, AVX2).
inline __m256i bytes_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

template <Kind K, typename S, int H, int MT>
void group_tile(const RView& w, int64_t g, const Q8Rows& a, int64_t i0, float* out) {
  constexpr int J = kJ<K>;
  __m256 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint8_t* codes = w.codes + g * w.group_bytes;
  const S* scales = static_cast<const S*>(w.scales) + g * w.blocks * H * kGroup;
  const S* mins = w.mins ? static_cast<const S*>(w.mins) + g * w.blocks * H * kGroup : nullptr;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* cb = codes + b * J * 64;
    for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetchBytes + j * 64), _MM_HINT_T0);
    for (int lanes = 0; lanes < 2; ++lanes) {  // rows 0..7, then 8..15 of the group
      __m256 dw[H], mw[H];
      for (int h = 0; h < H; ++h) {
        dw[h] = load8(scales + (b * H + h) * kGroup + 8 * lanes);
        mw[h] = _mm256_setzero_ps();
        if constexpr (kHasMins<K>) mw[h] = load8(mins + (b * H + h) * kGroup + 8 * lanes);
        else if constexpr (kHasOffset<K>) mw[h] = _mm256_mul_ps(dw[h], _mm256_set1_ps(-kBias<K>));
      }
      __m256i wv[8];
      if constexpr (kNibbles<K>) {
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64 + 32 * lanes));
          wv[2 * j] = _mm256_and_si256(raw, mask);
          wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
        for (int plane = 0; plane < kPlanes<K>; ++plane) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << plane));
          for (int v = 0; v < 8; ++v) {
            const auto bits = static_cast<uint32_t>(plane_bits(cb, plane, v) >> (32 * lanes));
            wv[v] = _mm256_or_si256(wv[v], _mm256_and_si256(bytes_of_bits(bits), bit));
          }
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64 + 32 * lanes));
#if defined(GX_Q8_VNNI)
          if constexpr (K == Kind::S8) wv[j] = _mm256_xor_si256(wv[j], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
        }
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* xb = a.q_row(i0 + i) + b * kBlock;
        __m256i z[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // elements 0..15, 16..31
        for (int j = 0; j < 4; ++j) {
          z[0] = dot4<K>(z[0], wv[kNibbles<K> ? 2 * j : j], load_i32(xb + 4 * j));
          z[1] = dot4<K>(z[1], wv[kNibbles<K> ? 2 * j + 1 : j + 4], load_i32(xb + 16 + 4 * j));
        }
        const __m256 dx = _mm256_set1_ps(a.d_row(i0 + i)[b]);
        if constexpr (H == 1) z[0] = _mm256_add_epi32(z[0], z[1]);
        for (int h = 0; h < H; ++h) {
          acc[i][lanes] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(z[h]), _mm256_mul_ps(dw[h], dx), acc[i][lanes]);
          const float sx = H == 1 ? a.s_row(i0 + i)[b] : a.s2_row(i0 + i)[2 * b + h];
          if constexpr (kHasOffset<K>) acc[i][lanes] = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(sx), acc[i][lanes]);
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kGroup, w.n - g * kGroup);
  for (int i = 0; i < MT; ++i) {
    alignas(32) float lanes[kGroup];
    _mm256_store_ps(lanes, acc[i][0]);
    _mm256_store_ps(lanes + 8, acc[i][1]);
    std::copy(lanes, lanes + valid, out + (i0 + i) * w.n + g * kGroup);
  }
}

#else
template <Kind K, typename S, int H, int MT>
void group_tile(const RView& w, int64_t g, const Q8Rows& a, int64_t i0, float* out) {
  constexpr int J = kJ<K>;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const int64_t valid = std::min<int64_t>(kGroup, w.n - g * kGroup);
  for (int i = 0; i < MT; ++i) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* cb = w.codes + g * w.group_bytes + b * J * 64;
      const int8_t* xb = a.q_row(i0 + i) + b * kBlock;
      const float dx = a.d_row(i0 + i)[b];
      for (int r = 0; r < kGroup; ++r) {
        int sums[2] = {0, 0};  // elements 0..15, 16..31
        for (int j = 0; j < (kNibbles<K> ? 4 : 8); ++j)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = cb[(j * kGroup + r) * 4 + t];
            if constexpr (kNibbles<K>) {
              int low = byte & 0x0F, high = byte >> 4;
              for (int plane = 0; plane < kPlanes<K>; ++plane) {
                low |= static_cast<int>((plane_bits(cb, plane, 2 * j) >> (4 * r + t)) & 1) << (4 + plane);
                high |= static_cast<int>((plane_bits(cb, plane, 2 * j + 1) >> (4 * r + t)) & 1) << (4 + plane);
              }
              sums[0] += low * xb[4 * j + t];
              sums[1] += high * xb[16 + 4 * j + t];
            } else {
              sums[j / 4] += static_cast<int8_t>(byte) * xb[4 * j + t];
            }
          }
        if constexpr (H == 1) sums[0] += sums[1];
        for (int h = 0; h < H; ++h) {
          const int64_t at = ((g * w.blocks + b) * H + h) * kGroup + r;
          const float sx = H == 1 ? a.s_row(i0 + i)[b] : a.s2_row(i0 + i)[2 * b + h];
          acc[r] = std::fma(static_cast<float>(scales[at]) * dx, static_cast<float>(sums[h]), acc[r]);
          if constexpr (kHasMins<K>) acc[r] = std::fma(static_cast<float>(mins[at]), sx, acc[r]);
          else if constexpr (K == Kind::U6) acc[r] = std::fma(-kBias<K> * static_cast<float>(scales[at]), sx, acc[r]);
        }
      }
    }
    std::copy(acc, acc + valid, out + (i0 + i) * w.n + g * kGroup);
  }
}
#endif

template <Kind K, typename S, int H>
void stream(const RView& w, const Q8Rows& a, float* out) {
  at::parallel_for(0, w.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t i = 0;
      for (; i + 4 <= a.m; i += 4) group_tile<K, S, H, 4>(w, g, a, i, out);
      for (; i + 2 <= a.m; i += 2) group_tile<K, S, H, 2>(w, g, a, i, out);
      for (; i < a.m; ++i) group_tile<K, S, H, 1>(w, g, a, i, out);
    }
  });
}

// The scale layouts in use: float16 per block (Q4_x, Q8_0, Q5_x), float32 per block (Q4_K,
// Q5_K), float32 per half block (Q6_K; view_of refuses float16 halves).
template <Kind K>
void stream_any(const RView& w, const Q8Rows& a, float* out) {
  if (!w.fp32) stream<K, c10::Half, 1>(w, a, out);
  else if (!w.halves) stream<K, float, 1>(w, a, out);
  else stream<K, float, 2>(w, a, out);
}

at::Tensor qlinear_q8_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, int64_t n) {
  const RView w = view_of(codes, scales, mins, n);
  TORCH_CHECK(x.size(-1) == w.k, "qlinear_q8: input has ", x.size(-1), " features, the weight takes ", w.k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qlinear_q8: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  const at::Tensor x32 = x.reshape({-1, w.k}).to(at::kFloat).contiguous();
  const int64_t m = x32.size(0);
  at::Tensor out = at::empty({m, n}, x32.options());
  if (m > 0) {
    const Q8Rows a = quantize(x32.data_ptr<float>(), m, w.k);
    switch (w.kind) {
      case Kind::U4: stream_any<Kind::U4>(w, a, out.data_ptr<float>()); break;
      case Kind::U6: stream_any<Kind::U6>(w, a, out.data_ptr<float>()); break;
      case Kind::S8: stream_any<Kind::S8>(w, a, out.data_ptr<float>()); break;
      case Kind::U5: stream_any<Kind::U5>(w, a, out.data_ptr<float>()); break;
    }
  }
  return out.to(x.scalar_type()).view(out_shape);
}

// The activation quantization alone, for tests and references: codes, d and s per block.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.size(-1) % kBlock == 0, "quantize_q8: the last dimension ", x.size(-1), " is not a multiple of 32");
  const at::Tensor x32 = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t m = x32.size(0), k = x32.size(1), blocks = k / kBlock;
  const Q8Rows a = quantize(x32.data_ptr<float>(), m, k);
  at::Tensor q = at::empty({m, k}, x32.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, blocks}, x32.options()), s = at::empty({m, blocks}, x32.options());
  std::copy(a.q.begin(), a.q.end(), q.data_ptr<int8_t>());
  std::copy(a.d.begin(), a.d.end(), d.data_ptr<float>());
  std::copy(a.s.begin(), a.s.end(), s.data_ptr<float>());
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
