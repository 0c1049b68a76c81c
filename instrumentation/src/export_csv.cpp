// export_csv.cpp — the history as CSV (header kHistoryCsvHeader, docs/EXPORTS.md),
// and the reader the trace replay uses to load it back.
#include <fmt/format.h>

#include <charconv>
#include <fstream>
#include <sstream>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/exports.hpp"

namespace mem {
namespace {

// RFC 4180 quoting, only when needed (module paths rarely contain commas).
void append_field(std::string& out, std::string_view field) {
  if (field.find_first_of(",\"\n\r") == std::string_view::npos) {
    out.append(field);
    return;
  }
  out.push_back('"');
  for (char c : field) {
    if (c == '"') out.push_back('"');
    out.push_back(c);
  }
  out.push_back('"');
}

std::vector<std::string> split_csv_line(std::string_view line, std::size_t line_number) {
  std::vector<std::string> fields;
  std::string field;
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        field.push_back('"');
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field.push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.push_back(std::move(field));
      field.clear();
    } else {
      field.push_back(c);
    }
  }
  if (quoted) throw Error(fmt::format("history CSV line {}: unterminated quoted field", line_number));
  fields.push_back(std::move(field));
  return fields;
}

template <class T>
T parse_number(const std::string& text, std::string_view column, std::size_t line_number) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) {
    throw Error(fmt::format("history CSV line {}: column {} is '{}', expected a number",
                            line_number, column, text));
  }
  return value;
}

TraceAction parse_action(const std::string& text, std::size_t line_number) {
  for (auto a : {TraceAction::Alloc, TraceAction::FreeRequested, TraceAction::FreeCompleted,
                 TraceAction::SegmentAlloc, TraceAction::SegmentFree, TraceAction::SegmentMap,
                 TraceAction::SegmentUnmap, TraceAction::Oom}) {
    if (trace_action_name(a) == text) return a;
  }
  throw Error(fmt::format(
      "history CSV line {}: unknown action '{}'; expected alloc, free_requested, "
      "free_completed, segment_alloc, segment_free, segment_map, segment_unmap or oom",
      line_number, text));
}

}  // namespace

std::string history_csv(const std::vector<HistoryEntry>& entries) {
  std::string out;
  out.reserve(64 + entries.size() * 96);
  out.append(kHistoryCsvHeader);
  out.push_back('\n');
  for (const HistoryEntry& e : entries) {
    const ContextInfo& owner = context_info(e.context);
    out += fmt::format("{},{:.3f},{},{},{},{},{},", e.sequence, e.time_us,
                       trace_action_name(e.action), e.address, e.size, e.requested_size, e.stream);
    append_field(out, owner.path);
    out += fmt::format(",{},{},{},{},{}\n", phase_name(owner.phase),
                       e.small_pool ? "small" : "large", e.allocated_bytes, e.reserved_bytes,
                       e.device_used_bytes);
  }
  return out;
}

void write_history_csv(const std::vector<HistoryEntry>& entries, const std::filesystem::path& path) {
  write_output_file(path, history_csv(entries), "mem::write_history_csv");
}

std::vector<HistoryEntry> read_history_csv(const std::filesystem::path& path) {
  check_input_file(path, "mem::read_history_csv: the history");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("mem::read_history_csv: cannot open '" + path.string() + "'");
  std::string line;
  const std::string what = "mem::read_history_csv: '" + path.string() + "'";
  if (!read_line(in, line, what, 1)) throw Error(what + " is empty");
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (line != kHistoryCsvHeader) {
    throw Error(fmt::format("mem::read_history_csv: '{}' does not start with the header\n  {}\n"
                            "(schema version {}); got\n  {}",
                            path.string(), kHistoryCsvHeader, kHistoryCsvSchemaVersion, line));
  }
  std::vector<HistoryEntry> entries;
  std::size_t line_number = 1;
  while (read_line(in, line, what, line_number + 1)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const auto f = split_csv_line(line, line_number);
    if (f.size() != 13) {
      throw Error(fmt::format("history CSV line {}: {} columns, expected 13", line_number, f.size()));
    }
    HistoryEntry e;
    e.sequence = parse_number<std::uint64_t>(f[0], "seq", line_number);
    e.time_us = parse_number<double>(f[1], "time_us", line_number);
    e.action = parse_action(f[2], line_number);
    e.address = parse_number<std::uintptr_t>(f[3], "address", line_number);
    e.size = parse_number<std::size_t>(f[4], "size", line_number);
    e.requested_size = parse_number<std::size_t>(f[5], "requested_size", line_number);
    e.stream = parse_number<StreamId>(f[6], "stream", line_number);
    e.context = intern_context(f[7], parse_phase(f[8]));
    if (f[9] != "small" && f[9] != "large") {
      throw Error(fmt::format("history CSV line {}: pool is '{}', expected small or large",
                              line_number, f[9]));
    }
    e.small_pool = f[9] == "small";
    e.allocated_bytes = parse_number<std::size_t>(f[10], "allocated_bytes", line_number);
    e.reserved_bytes = parse_number<std::size_t>(f[11], "reserved_bytes", line_number);
    e.device_used_bytes = parse_number<std::size_t>(f[12], "device_used_bytes", line_number);
    entries.push_back(e);
  }
  return entries;
}

}  // namespace mem
