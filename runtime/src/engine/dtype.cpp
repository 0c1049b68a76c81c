// dtype.cpp — dtype names and IEEE half conversions.
#include "vramscope/runtime/dtype.hpp"

#include <array>
#include <limits>
#include <string>

#include "vramscope/allocator/errors.hpp"

namespace mem::nn {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::Bool: return "bool";
    case DType::I32: return "i32";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::F32;
  if (name == "f16" || name == "float16" || name == "half") return DType::F16;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "f64" || name == "float64" || name == "double") return DType::F64;
  if (name == "i64" || name == "int64" || name == "long") return DType::I64;
  if (name == "u8" || name == "uint8") return DType::U8;
  if (name == "bool") return DType::Bool;
  if (name == "i32" || name == "int32" || name == "int") return DType::I32;
  throw Error("unknown dtype '" + std::string(name) + "'; expected one of f32, f16, bf16, f64, i64, u8, bool, i32");
}

std::uint16_t float_to_half(float value) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // rounds to zero
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp - 150); half subnormals count units of 2^-24.
    const std::uint32_t s = 126 - exp;  // 14..24 bits dropped
    const std::uint32_t dropped = mant & ((1u << s) - 1u);
    const std::uint32_t halfway = 1u << (s - 1);
    std::uint32_t half = mant >> s;
    if (dropped > halfway || (dropped == halfway && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  // normal: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits
  std::uint32_t bits = abs - 0x38000000u;  // (127 - 15) << 23
  const std::uint32_t dropped = bits & 0x1fffu;
  bits >>= 13;
  if (dropped > 0x1000u || (dropped == 0x1000u && (bits & 1u))) ++bits;
  return static_cast<std::uint16_t>(sign | bits);
}

namespace {
float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 113;  // 127 - 15 + 1
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

/// All 65536 halves decoded once: compute mode converts whole tensors at a time.
struct HalfTable {
  HalfTable() {
    for (std::uint32_t h = 0; h < 65536; ++h) values[h] = half_bits_to_float(static_cast<std::uint16_t>(h));
  }
  std::array<float, 65536> values;
};
const HalfTable kHalfTable;
}  // namespace

float half_to_float(std::uint16_t h) noexcept { return kHalfTable.values[h]; }

double finfo_min(DType dtype) noexcept {
  switch (dtype) {
    case DType::F16: return -65504.0;
    case DType::BF16: return -3.3895313892515355e38;
    case DType::F64: return std::numeric_limits<double>::lowest();
    default: return std::numeric_limits<float>::lowest();
  }
}

}  // namespace mem::nn
