// dtype.hpp — element types of runtime tensors and the 16-bit float conversions.
//
// f16 and bf16 are stored as 16-bit words and computed by converting to f32,
// as a GPU kernel would load them; f64 exists for finite-difference tests;
// i64 holds indices (embedding, max-pool argmax, class targets) and u8/bool masks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace mem::nn {

/// I32 is what an operator-level model records (int32 indices, cumulative sequence lengths).
enum class DType : std::uint8_t { F32, F16, BF16, F64, I64, U8, Bool, I32 };

/// Bytes per element: 4, 2, 2, 8, 8, 1, 1, 4.
constexpr std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F64: case DType::I64: return 8;
    case DType::U8: case DType::Bool: return 1;
  }
  return 0;
}

constexpr bool is_floating(DType dtype) noexcept {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16 || dtype == DType::F64;
}
/// True for the 16-bit float types.
constexpr bool is_half(DType dtype) noexcept { return dtype == DType::F16 || dtype == DType::BF16; }

/// "f32", "f16", "bf16", "f64", "i64", "u8", "bool", "i32".
std::string_view dtype_name(DType dtype) noexcept;
/// torch.finfo(dtype).min: the value Hugging Face's causal masks fill with.
double finfo_min(DType dtype) noexcept;
/// Inverse of dtype_name() (also accepts "float32", "float16", "half", "bfloat16").
/// Throws mem::Error listing the valid names.
DType parse_dtype(std::string_view name);

/// IEEE binary16 <-> float, round to nearest even.
std::uint16_t float_to_half(float value) noexcept;
float half_to_float(std::uint16_t bits) noexcept;

/// bfloat16 <-> float, round to nearest even (NaN stays NaN).
inline std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}
inline float bf16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

}  // namespace mem::nn
