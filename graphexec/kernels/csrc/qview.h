// The packed weight layout both qlinear kernels read (float activations: qlinear.cpp; 8-bit
// activations: qlinear_q8.cpp), and its checks.  graphexec/quant/formats.py packs it at load:
//   4-bit: codes uint8 [N, K/2]; per 32-element block, byte j holds element j (low nibble) and
//          element j+16 (high nibble), as GGUF stores it.  value = d * q + m.
//   8-bit: codes int8 [N, K]; value = d * q.
//   scales (d) and mins (m): float16 [N, K/32]; Q4_0 is packed as m = -8 d (exact in fp16).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

namespace graphexec_kernels {

constexpr int64_t kBlock = 32;

struct QView {
  const uint8_t* codes;
  const c10::Half* scales;
  const c10::Half* mins;  // null: no offset (8-bit)
  int64_t n, k, blocks, row_bytes;
  bool four_bit;
};

inline QView view_of(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins) {
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

}  // namespace graphexec_kernels
