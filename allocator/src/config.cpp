// config.cpp — PYTORCH_CUDA_ALLOC_CONF parsing and the size-class policy
// (round_size, segment sizes), following c10/cuda/CUDAAllocatorConfig.cpp.
#include "vramscope/allocator/config.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

constexpr std::string_view kValidKeys =
    "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold, "
    "expandable_segments, backend";

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

[[noreturn]] void fail(std::string_view conf, const std::string& why) {
  throw Error("invalid allocator config \"" + std::string(conf) + "\": " + why +
              " (valid keys: " + std::string(kValidKeys) +
              "; e.g. \"max_split_size_mb:128,roundup_power2_divisions:[256:1,>:8]\")");
}

std::size_t parse_unsigned(std::string_view conf, std::string_view key, std::string_view text) {
  text = trim(text);
  std::size_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size()) {
    fail(conf, std::string(key) + " expects a non-negative integer, got \"" + std::string(text) +
                   "\"");
  }
  return value;
}

std::size_t index_of_power2(std::size_t v) { return static_cast<std::size_t>(std::bit_width(v) - 1); }

// Splits "a:b,c:[d:e,f:g]" at top-level commas.
std::vector<std::string_view> split_options(std::string_view conf) {
  std::vector<std::string_view> out;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < conf.size(); ++i) {
    if (conf[i] == '[') ++depth;
    if (conf[i] == ']') --depth;
    if (conf[i] == ',' && depth == 0) {
      out.push_back(conf.substr(start, i - start));
      start = i + 1;
    }
  }
  out.push_back(conf.substr(start));
  return out;
}

void parse_divisions(std::string_view conf, std::string_view value, AllocatorConfig& cfg) {
  const std::string_view key = "roundup_power2_divisions";
  if (value.empty() || value.front() != '[') {
    const std::size_t d = parse_unsigned(conf, key, value);
    if (d != 0 && !std::has_single_bit(d)) fail(conf, "roundup_power2_divisions must be a power of 2");
    cfg.roundup_power2_divisions.fill(d);
    return;
  }
  if (value.back() != ']') fail(conf, "roundup_power2_divisions list must end with ']'");
  std::string_view list = value.substr(1, value.size() - 2);
  if (trim(list).empty()) fail(conf, "roundup_power2_divisions list is empty");
  bool first = true;
  std::size_t last_index = 0;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    std::size_t comma = list.find(',', pos);
    if (comma == std::string_view::npos) comma = list.size();
    const std::string_view item = trim(list.substr(pos, comma - pos));
    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      fail(conf, "roundup_power2_divisions list items are interval_mb:divisions, got \"" +
                     std::string(item) + "\"");
    }
    const std::string_view interval = trim(item.substr(0, colon));
    const std::size_t divisions = parse_unsigned(conf, key, item.substr(colon + 1));
    if (divisions != 0 && !std::has_single_bit(divisions)) {
      fail(conf, "roundup_power2_divisions: divisions must be a power of 2, got " +
                     std::to_string(divisions));
    }
    auto& table = cfg.roundup_power2_divisions;
    if (interval == ">") {
      for (std::size_t i = last_index; i < table.size(); ++i) table[i] = divisions;
    } else {
      const std::size_t mb = parse_unsigned(conf, key, interval);
      if (mb == 0 || !std::has_single_bit(mb)) {
        fail(conf, "roundup_power2_divisions: intervals must be powers of 2 (in MiB), got \"" +
                       std::string(interval) + "\"");
      }
      const std::size_t index = std::min(index_of_power2(mb), table.size() - 1);
      // As PyTorch: the first entry also covers every smaller interval.
      if (first) {
        for (std::size_t i = 0; i < index; ++i) table[i] = divisions;
        first = false;
      }
      table[index] = divisions;
      last_index = index;
    }
    pos = comma + 1;
  }
}

}  // namespace

AllocatorConfig AllocatorConfig::parse(std::string_view conf) {
  AllocatorConfig cfg;
  if (trim(conf).empty()) return cfg;
  std::vector<std::string_view> seen;  // a key given twice is a mistake, not an override
  for (std::string_view option : split_options(conf)) {
    option = trim(option);
    if (option.empty()) fail(conf, "empty option (stray comma?)");
    const std::size_t colon = option.find(':');
    if (colon == std::string_view::npos) {
      fail(conf, "option \"" + std::string(option) + "\" has no ':' (expected key:value)");
    }
    const std::string_view key = trim(option.substr(0, colon));
    const std::string_view value = trim(option.substr(colon + 1));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      fail(conf, "key \"" + std::string(key) + "\" is given twice; keep one");
    }
    seen.push_back(key);
    if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
      const std::size_t mb = parse_unsigned(conf, key, value);
      constexpr std::size_t min_mb = kLargeBuffer / (1024 * 1024);
      if (mb < min_mb) {
        fail(conf, std::string(key) + " must be >= " + std::to_string(min_mb) + ", got " +
                       std::to_string(mb));
      }
      constexpr std::size_t max_mb = std::numeric_limits<std::size_t>::max() / (1024 * 1024);
      const std::size_t bytes = std::min(mb, max_mb) * 1024 * 1024;
      (key == "max_split_size_mb" ? cfg.max_split_size : cfg.max_non_split_rounding_size) = bytes;
    } else if (key == "roundup_power2_divisions") {
      parse_divisions(conf, value, cfg);
    } else if (key == "garbage_collection_threshold") {
      std::string text(value);
      char* end = nullptr;
      const double t = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size()) {
        fail(conf, "garbage_collection_threshold expects a number, got \"" + text + "\"");
      }
      if (!(t > 0.0 && t < 1.0)) {
        fail(conf, "garbage_collection_threshold must be between 0.0 and 1.0 (exclusive), got " +
                       text);
      }
      cfg.garbage_collection_threshold = t;
    } else if (key == "expandable_segments") {
      if (value == "True" || value == "true") {
        cfg.expandable_segments = true;
      } else if (value == "False" || value == "false") {
        cfg.expandable_segments = false;
      } else {
        fail(conf, "expandable_segments expects True or False, got \"" + std::string(value) + "\"");
      }
    } else if (key == "backend") {
      if (value != "native") {
        fail(conf, "backend \"" + std::string(value) + "\" is not supported (only native)");
      }
    } else {
      fail(conf, "unknown key \"" + std::string(key) + "\"");
    }
  }
  return cfg;
}

AllocatorConfig AllocatorConfig::from_env() {
  if (const char* conf = std::getenv("VRAMSCOPE_ALLOC_CONF")) return parse(conf);
  if (const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF")) return parse(conf);
  return {};
}

std::string AllocatorConfig::to_string() const {
  std::vector<std::string> parts;
  if (max_split_size != std::numeric_limits<std::size_t>::max()) {
    parts.push_back("max_split_size_mb:" + std::to_string(max_split_size / (1024 * 1024)));
  }
  if (max_non_split_rounding_size != kLargeBuffer) {
    parts.push_back("max_non_split_rounding_mb:" +
                    std::to_string(max_non_split_rounding_size / (1024 * 1024)));
  }
  const auto& t = roundup_power2_divisions;
  const bool any = std::any_of(t.begin(), t.end(), [](std::size_t d) { return d != 0; });
  if (any) {
    const bool uniform = std::all_of(t.begin(), t.end(), [&](std::size_t d) { return d == t[0]; });
    if (uniform) {
      parts.push_back("roundup_power2_divisions:" + std::to_string(t[0]));
    } else {
      // Every interval explicitly: unambiguous under PyTorch's fill rules.
      std::string list = "roundup_power2_divisions:[";
      for (std::size_t i = 0; i < t.size(); ++i) {
        if (i > 0) list += ",";
        list += std::to_string(std::size_t{1} << i) + ":" + std::to_string(t[i]);
      }
      parts.push_back(list + "]");
    }
  }
  if (garbage_collection_threshold > 0.0) {
    std::ostringstream os;
    os << garbage_collection_threshold;
    parts.push_back("garbage_collection_threshold:" + os.str());
  }
  if (expandable_segments) parts.push_back("expandable_segments:True");
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : ",") + p;
  return out;
}

std::size_t AllocatorConfig::divisions_for(std::size_t size) const noexcept {
  // Intervals start at 1 MiB (2^20) and end at 64 GiB.
  const int log_size = std::bit_width(size) - 1;
  int index = log_size - 20;
  index = std::max(index, 0);
  index = std::min(index, static_cast<int>(kRoundUpPowerOfTwoIntervals) - 1);
  return roundup_power2_divisions[static_cast<std::size_t>(index)];
}

namespace {
std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) {
  if (std::has_single_bit(size)) return size;
  const std::size_t power2_floor = std::bit_floor(size);
  const std::size_t division = power2_floor >> index_of_power2(divisions);
  if (division == 0) return power2_floor << 1;
  const std::size_t round_floor = size & ~(division - 1);
  return round_floor == size ? size : round_floor + division;
}
}  // namespace

std::size_t round_size(std::size_t size, const AllocatorConfig& config) noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  if (size > kMaxRequestSize) return std::numeric_limits<std::size_t>::max();
  const std::size_t divisions = config.divisions_for(size);
  if (divisions > 1 && size > kMinBlockSize * divisions) {
    return roundup_power2_next_division(size, divisions);
  }
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

std::size_t segment_size_for(std::size_t rounded_size) noexcept {
  if (rounded_size <= kSmallSize) return kSmallBuffer;
  if (rounded_size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded_size + kRoundLarge - 1) / kRoundLarge);
}

}  // namespace mem
