// units.cpp — byte sizes for people: PyTorch-style formatting ("20.00 MiB")
// and a strict parser for sizes in specs and configs ("8GiB", "400 MiB", "1.5GB").
#include "vramscope/allocator/units.hpp"

#include <array>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <string>

#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

// Exact arithmetic for "1.5GiB"-style inputs: the fraction times the unit can exceed 64 bits
// before the division by 10^digits brings it back. __extension__ keeps -Wpedantic quiet.
__extension__ using u128 = unsigned __int128;

struct Unit {
  std::string_view name;  // compared case-insensitively
  std::size_t multiplier;
};

// Binary units (KiB, and the bare letter as `ls -h`/PyTorch users write it) are powers of 1024;
// KB/MB/GB/TB are SI powers of 1000 as GPU vendors and disk makers quote them.
constexpr std::array<Unit, 19> kUnits{{
    {"", 1},
    {"b", 1},
    {"k", KiB},
    {"kib", KiB},
    {"kb", 1000},
    {"m", MiB},
    {"mib", MiB},
    {"mb", 1000 * 1000},
    {"g", GiB},
    {"gib", GiB},
    {"gb", 1000 * 1000 * 1000},
    {"t", GiB * 1024},
    {"tib", GiB * 1024},
    {"tb", std::size_t{1000} * 1000 * 1000 * 1000},
    {"p", GiB * 1024 * 1024},  // format_bytes prints PiB past 1024 TiB; read it back too
    {"pib", GiB * 1024 * 1024},
    {"pb", std::size_t{1000} * 1000 * 1000 * 1000 * 1000},
    {"byte", 1},
    {"bytes", 1},
}};

constexpr std::string_view kAcceptedForms =
    "expected a non-negative whole or decimal number with an optional unit: "
    "B, KiB/MiB/GiB/TiB/PiB or K/M/G/T/P (powers of 1024), KB/MB/GB/TB/PB (powers of 1000); "
    "e.g. \"4096\", \"400MiB\", \"8 GiB\", \"1.5GB\"";

[[noreturn]] void fail(std::string_view text, std::string_view why) {
  std::string msg = "invalid byte size \"";
  msg += text;
  msg += "\": ";
  msg += why;
  msg += "; ";
  msg += kAcceptedForms;
  throw Error(msg);
}

bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string format_magnitude(std::uint64_t bytes) {
  char buf[64];
  if (bytes < KiB) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
    return buf;
  }
  static constexpr std::array<std::string_view, 5> kNames{"KiB", "MiB", "GiB", "TiB", "PiB"};
  std::size_t unit = 0;
  long double value = static_cast<long double>(bytes) / 1024.0L;
  // Move up while the value would print as 1024.00 or more, so 1 MiB - 1 B reads
  // "1.00 MiB" rather than "1024.00 KiB".
  while (unit + 1 < kNames.size() && value >= 1024.0L - 0.005L) {
    value /= 1024.0L;
    ++unit;
  }
  std::snprintf(buf, sizeof buf, "%.2Lf %.*s", value, static_cast<int>(kNames[unit].size()),
                kNames[unit].data());
  return buf;
}

}  // namespace

std::string format_bytes(std::size_t bytes) { return format_magnitude(bytes); }

std::string format_address(std::uintptr_t address) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, address);
  return buf;
}

std::string format_bytes_delta(std::int64_t bytes) {
  if (bytes == 0) return "0 B";
  // Negate in unsigned arithmetic so INT64_MIN has a magnitude too.
  const std::uint64_t magnitude = bytes < 0 ? std::uint64_t{0} - static_cast<std::uint64_t>(bytes)
                                            : static_cast<std::uint64_t>(bytes);
  // Appending (not `"+" + string`) sidesteps GCC 12's false -Wrestrict (bug 105329).
  std::string out(1, bytes < 0 ? '-' : '+');
  out += format_magnitude(magnitude);
  return out;
}

std::size_t parse_bytes(std::string_view text, bool allow_zero) {
  std::size_t i = 0;
  const std::size_t n = text.size();
  while (i < n && is_space(text[i])) ++i;
  if (i == n) fail(text, "empty");
  if (text[i] == '-') fail(text, "negative sizes are not allowed");
  if (text[i] == '+') ++i;

  // Whole part, then an optional fraction; both kept as integers for exact results.
  const std::size_t whole_begin = i;
  std::uint64_t whole = 0;
  bool whole_overflow = false;
  while (i < n && is_digit(text[i])) {
    const std::uint64_t digit = static_cast<std::uint64_t>(text[i] - '0');
    if (whole > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) whole_overflow = true;
    whole = whole * 10 + digit;
    ++i;
  }
  const bool has_whole = i > whole_begin;
  std::uint64_t frac = 0;
  std::uint64_t frac_scale = 1;
  bool has_frac = false;
  if (i < n && text[i] == '.') {
    ++i;
    while (i < n && is_digit(text[i])) {
      // 18 digits are far below a byte even in TiB; later digits cannot change the result.
      if (frac_scale < 1'000'000'000'000'000'000ULL) {
        frac = frac * 10 + static_cast<std::uint64_t>(text[i] - '0');
        frac_scale *= 10;
      }
      has_frac = true;
      ++i;
    }
  }
  if (!has_whole && !has_frac) fail(text, "no number");

  while (i < n && is_space(text[i])) ++i;
  std::size_t unit_end = n;
  while (unit_end > i && is_space(text[unit_end - 1])) --unit_end;
  const std::string unit = lower(text.substr(i, unit_end - i));
  std::size_t multiplier = 0;
  for (const Unit& u : kUnits) {
    if (unit == u.name) {
      multiplier = u.multiplier;
      break;
    }
  }
  if (multiplier == 0) {
    fail(text, unit.find_first_of("0123456789.+-") != std::string::npos
                   ? "unexpected characters after the number"
                   : "unknown unit \"" + unit + "\"");
  }
  if (has_frac && frac != 0 && multiplier == 1) fail(text, "a byte count must be a whole number");

  constexpr u128 kMax = std::numeric_limits<std::size_t>::max();
  if (whole_overflow) fail(text, "too large (the limit is 16 EiB)");
  const u128 whole_bytes = static_cast<u128>(whole) * multiplier;
  // Fractions of a unit round down to a whole byte ("0.3GiB" is 322122547 B).
  const u128 frac_bytes = static_cast<u128>(frac) * multiplier / frac_scale;
  const u128 total = whole_bytes + frac_bytes;
  if (whole_bytes > kMax || total > kMax) fail(text, "too large (the limit is 16 EiB)");
  if (total == 0 && !allow_zero) fail(text, "must be greater than zero");
  return static_cast<std::size_t>(total);
}

}  // namespace mem
