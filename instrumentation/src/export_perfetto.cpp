// export_perfetto.cpp — a Timeline as Chrome trace-event JSON (ui.perfetto.dev,
// chrome://tracing): three counter tracks and one slice per module scope.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"

namespace mem {
namespace {

using nlohmann::ordered_json;

constexpr int kPid = 1;

ordered_json counter(const char* name, double ts, std::size_t bytes) {
  // One counter name per series: a multi-argument counter would be drawn stacked.
  return ordered_json{{"name", name}, {"ph", "C"},  {"ts", ts},
                      {"pid", kPid},  {"tid", 0},   {"args", ordered_json{{"bytes", bytes}}}};
}

}  // namespace

std::string perfetto_trace_json(const Timeline& timeline) {
  const auto samples = timeline.samples();
  const auto slices = timeline.slices();
  const double end = timeline.end_us();

  ordered_json events = ordered_json::array();
  events.push_back(ordered_json{{"name", "process_name"}, {"ph", "M"}, {"pid", kPid}, {"tid", 0},
                                {"args", {{"name", "vramscope " + timeline.device_info().name}}}});
  std::set<std::uint32_t> threads;
  for (const TimelineSlice& s : slices) threads.insert(s.thread);
  for (std::uint32_t t : threads) {
    events.push_back(ordered_json{{"name", "thread_name"}, {"ph", "M"}, {"pid", kPid},
                                  {"tid", t + 1},
                                  {"args", {{"name", "modules (thread " + std::to_string(t) + ")"}}}});
  }
  for (const TimelineSample& s : samples) {
    events.push_back(counter("allocated", s.time_us, s.allocated_bytes));
    events.push_back(counter("reserved", s.time_us, s.reserved_bytes));
    events.push_back(counter("nvidia-smi view", s.time_us, s.device_used_bytes));
  }
  for (const TimelineOom& oom : timeline.ooms()) {
    events.push_back(ordered_json{
        {"name", "out of memory (asked " + format_bytes(oom.requested_bytes) + ")"},
        {"ph", "i"}, {"s", "g"}, {"ts", oom.time_us}, {"pid", kPid}, {"tid", 0},
        {"args", {{"requested_bytes", oom.requested_bytes},
                  {"allocated_bytes", oom.allocated_bytes},
                  {"reserved_bytes", oom.reserved_bytes}}}});
  }
  for (const TimelineSlice& s : slices) {
    const ContextInfo& info = context_info(s.context);
    const double stop = s.end_us < 0 ? end : s.end_us;
    // The step's own scope has the empty path: a slice needs a name to be found.
    events.push_back(ordered_json{{"name", info.path.empty() ? "step" : info.path},
                                  {"cat", phase_name(info.phase)},
                                  {"ph", "X"},
                                  {"ts", s.begin_us},
                                  {"dur", std::max(0.0, stop - s.begin_us)},
                                  {"pid", kPid},
                                  {"tid", s.thread + 1},
                                  {"args", {{"module", info.path},
                                            {"phase", phase_name(info.phase)},
                                            {"depth", s.depth}}}});
  }

  ordered_json doc;
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ms";
  // Under the Events clock one microsecond of the trace is one allocator event.
  const char* clock = timeline.clock() == TimelineClock::Events ? "allocator events (1 us = 1 event)"
                                                                : "host microseconds";
  doc["otherData"] = ordered_json{{"schema", "vramscope.perfetto"},
                                  {"version", kPerfettoSchemaVersion},
                                  {"clock", clock},
                                  {"device", timeline.device_info().name},
                                  {"device_total_bytes", timeline.device_total_bytes()},
                                  {"assumptions", timeline.device_info().assumptions}};
  return doc.dump() + "\n";
}

void write_perfetto_trace(const Timeline& timeline, const std::filesystem::path& path) {
  write_output_file(path, perfetto_trace_json(timeline), "mem::write_perfetto_trace");
}

}  // namespace mem
