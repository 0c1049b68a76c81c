// units.hpp — human byte units: "1.50 GiB" out, "8GiB" / "400MiB" / "123" in;
// addresses in hex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mem {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

/// Formats like PyTorch's OOM message: "20.00 MiB", "512 B", "1.50 GiB".
std::string format_bytes(std::size_t bytes);
/// Signed variant for deltas: "+2.00 MiB", "-512 B".
std::string format_bytes_delta(std::int64_t bytes);
/// A device address as error messages and PyTorch's snapshots show it: "0x7f3a00000000".
std::string format_address(std::uintptr_t address);

/// Parses "8GiB", "8 GiB", "400MiB", "1.5GB" (GB = 10^9), "4096", "2M" (M = MiB).
/// Throws mem::Error naming the accepted forms on anything else, or on zero when
/// `allow_zero` is false.
std::size_t parse_bytes(std::string_view text, bool allow_zero = false);

}  // namespace mem
