// summary.cpp — memory_summary(): the layout of torch.cuda.memory_summary(),
// the same column widths and unit rules, followed by vramscope's extra rows.
#include "vramscope/instrumentation/summary.hpp"

#include <fmt/format.h>

#include <array>
#include <optional>
#include <string_view>
#include <vector>

namespace mem {
namespace {

constexpr std::size_t kWidth = 75;

// PyTorch picks the unit from the row's "all" value so sub-rows line up.
std::string format_size(std::int64_t size, double unit_reference) {
  static constexpr std::array<std::string_view, 6> kPrefixes = {"B  ", "KiB", "MiB",
                                                                "GiB", "TiB", "PiB"};
  std::size_t prefix = 0;
  while (prefix + 1 < kPrefixes.size() && unit_reference >= 768.0 * 1024) {
    ++prefix;
    size /= 1024;
    unit_reference /= 1024;
  }
  return fmt::format("{:6d} {}", size, kPrefixes[prefix]);
}

std::string format_count(std::int64_t count, double unit_reference) {
  static constexpr std::array<std::string_view, 3> kPrefixes = {" ", "K", "M"};
  std::size_t prefix = 0;
  while (prefix + 1 < kPrefixes.size() && unit_reference >= 750.0 * 1000) {
    ++prefix;
    count /= 1000;
    unit_reference /= 1000;
  }
  return fmt::format("{:7d} {} ", count, kPrefixes[prefix]);
}

using Formatter = std::string (*)(std::int64_t, double);

void stat_row(std::vector<std::string>& lines, std::string_view name, const Stat& stat,
              const Stat& reference, Formatter format) {
  lines.push_back(fmt::format(" {:<21} | {} | {} | {} | {} ", name,
                              format(stat.current, static_cast<double>(reference.current)),
                              format(stat.peak, static_cast<double>(reference.peak)),
                              format(stat.allocated, static_cast<double>(reference.allocated)),
                              format(stat.freed, static_cast<double>(reference.freed))));
}

// A row with only some columns filled (the rest blank, 10 characters each).
void partial_row(std::vector<std::string>& lines, std::string_view name,
                 std::optional<std::int64_t> current, std::optional<std::int64_t> peak,
                 Formatter format) {
  auto cell = [&](std::optional<std::int64_t> v) {
    return v ? format(*v, static_cast<double>(*v)) : std::string(10, ' ');
  };
  lines.push_back(fmt::format(" {:<21} | {} | {} | {} | {} ", name, cell(current), cell(peak),
                              std::string(10, ' '), std::string(10, ' ')));
}

// Long text wrapped into table lines of the same width.
void text_rows(std::vector<std::string>& lines, std::string_view text) {
  constexpr std::size_t kText = kWidth - 2;
  while (!text.empty()) {
    std::size_t take = text.size() <= kText ? text.size() : text.rfind(' ', kText);
    if (take == std::string_view::npos || take == 0) take = std::min(kText, text.size());
    lines.push_back(fmt::format(" {:<{}} ", text.substr(0, take), kText));
    text.remove_prefix(take);
    while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  }
}

}  // namespace

std::string memory_summary(const Snapshot& snapshot, SummaryOptions options) {
  const DeviceStats& stats = snapshot.stats;
  std::vector<std::string> lines;
  lines.push_back(std::string(kWidth, '='));
  lines.push_back(fmt::format(" {:16} PyTorch CUDA memory summary, device ID {:<17} ", "",
                              options.device_index));
  lines.push_back(std::string(kWidth, '-'));
  lines.push_back(fmt::format("  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ", "",
                              stats.num_ooms, "", stats.num_alloc_retries));
  lines.push_back(std::string(kWidth, '='));
  lines.push_back("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ");

  struct Metric {
    const StatArray* stat;
    std::string_view name;
    Formatter format;
  };
  const std::array<Metric, 9> metrics = {{
      {&stats.allocated_bytes, "Allocated memory", format_size},
      {&stats.active_bytes, "Active memory", format_size},
      {&stats.requested_bytes, "Requested memory", format_size},
      {&stats.reserved_bytes, "GPU reserved memory", format_size},
      {&stats.inactive_split_bytes, "Non-releasable memory", format_size},
      {&stats.allocation, "Allocations", format_count},
      {&stats.active, "Active allocs", format_count},
      {&stats.segment, "GPU reserved segments", format_count},
      {&stats.inactive_split, "Non-releasable allocs", format_count},
  }};
  constexpr auto all = static_cast<std::size_t>(StatType::All);
  constexpr auto large = static_cast<std::size_t>(StatType::LargePool);
  constexpr auto small = static_cast<std::size_t>(StatType::SmallPool);
  for (const Metric& metric : metrics) {
    lines.push_back(std::string(kWidth, '-'));
    const StatArray& s = *metric.stat;
    stat_row(lines, metric.name, s[all], s[all], metric.format);
    if (!options.abbreviated) {
      stat_row(lines, "      from large pool", s[large], s[all], metric.format);
      stat_row(lines, "      from small pool", s[small], s[all], metric.format);
    }
  }
  lines.push_back(std::string(kWidth, '-'));
  stat_row(lines, "Oversize allocations", stats.oversize_allocations, stats.oversize_allocations,
           format_count);
  lines.push_back(std::string(kWidth, '-'));
  stat_row(lines, "Oversize GPU segments", stats.oversize_segments, stats.oversize_segments,
           format_count);

  // --- what PyTorch's table lacks ---------------------------------------------
  lines.push_back(std::string(kWidth, '='));
  lines.push_back(fmt::format(" {:<{}} ", "vramscope: the device view and fragmentation", kWidth - 2));
  lines.push_back(std::string(kWidth, '-'));
  stat_row(lines, "nvidia-smi view", stats.device_used_bytes, stats.device_used_bytes, format_size);
  partial_row(lines, "  of it CUDA context", stats.context_bytes, stats.context_bytes, format_size);
  partial_row(lines, "Device total", stats.device_total_bytes, std::nullopt, format_size);
  lines.push_back(std::string(kWidth, '-'));
  const Fragmentation frag = fragmentation(snapshot);
  partial_row(lines, "Reserved unallocated",
              static_cast<std::int64_t>(frag.reserved_unallocated_bytes), std::nullopt,
              format_size);
  if (snapshot.has_segments) {
    partial_row(lines, "Largest free block", static_cast<std::int64_t>(frag.largest_free_block),
                std::nullopt, format_size);
    partial_row(lines, "Free blocks", static_cast<std::int64_t>(frag.free_blocks), std::nullopt,
                format_count);
    text_rows(lines, fmt::format("Fragmentation (1 - largest free / reserved unallocated): {:.1f}%",
                                 100.0 * frag.ratio()));
  } else {
    text_rows(lines, "Largest free block: needs a snapshot with segments");
  }
  if (snapshot.device.info) {
    lines.push_back(std::string(kWidth, '-'));
    text_rows(lines, fmt::format("Device: {}", snapshot.device.info->name));
    if (!snapshot.device.info->assumptions.empty()) {
      text_rows(lines, snapshot.device.info->assumptions);
    }
  }
  lines.push_back(std::string(kWidth, '='));

  std::string out;
  for (const std::string& line : lines) {
    out += '|';
    out += line;
    out += "|\n";
  }
  return out;
}

std::string memory_summary(const CachingAllocator& allocator, SummaryOptions options) {
  return memory_summary(snapshot(allocator, {.segments = true}), options);
}

std::string memory_summary(SummaryOptions options) {
  return memory_summary(process_allocator(), options);
}

}  // namespace mem
