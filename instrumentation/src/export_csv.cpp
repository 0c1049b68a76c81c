// export_csv.cpp — the history as CSV (header kHistoryCsvHeader, docs/EXPORTS.md). The
// replay module reads it back (read_history_csv, read_history_trace).
#include <fmt/format.h>

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

}  // namespace mem
