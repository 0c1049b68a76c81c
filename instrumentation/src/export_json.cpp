// export_json.cpp — a snapshot as JSON (schema "vramscope.snapshot", docs/EXPORTS.md).
#include <nlohmann/json.hpp>

#include "vramscope/instrumentation/exports.hpp"

namespace mem {
namespace {

using nlohmann::ordered_json;

// PyTorch's memory_stats() keys ("allocated_bytes.all.current", ...) plus the device view.
ordered_json memory_stats_json(const DeviceStats& stats) {
  ordered_json out = ordered_json::object();
  for_each_stat_array(stats, [&](std::string_view name, const StatArray& array) {
    for (std::size_t t = 0; t < kNumStatTypes; ++t) {
      const std::string prefix = std::string(name) + "." + std::string(kStatTypeNames[t]) + ".";
      out[prefix + "current"] = array[t].current;
      out[prefix + "peak"] = array[t].peak;
      out[prefix + "allocated"] = array[t].allocated;
      out[prefix + "freed"] = array[t].freed;
    }
  });
  for_each_stat_counter(stats, [&](std::string_view name, const std::int64_t& value) {
    out[std::string(name)] = value;
  });
  for (const auto& [name, stat] : {std::pair<const char*, const Stat*>{"oversize_allocations",
                                                                      &stats.oversize_allocations},
                                   {"oversize_segments", &stats.oversize_segments},
                                   {"device_used_bytes", &stats.device_used_bytes}}) {
    out[std::string(name) + ".current"] = stat->current;
    out[std::string(name) + ".peak"] = stat->peak;
    out[std::string(name) + ".allocated"] = stat->allocated;
    out[std::string(name) + ".freed"] = stat->freed;
  }
  out["max_split_size"] = stats.max_split_size;
  out["device_total_bytes"] = stats.device_total_bytes;
  out["context_bytes"] = stats.context_bytes;
  out["driver_time_us"] = stats.driver_time_us;
  return out;
}

ordered_json owner_json(ContextId context) {
  const ContextInfo& info = context_info(context);
  return ordered_json{{"module", info.path}, {"phase", phase_name(info.phase)}};
}

}  // namespace

std::string snapshot_json(const Snapshot& snapshot, int indent) {
  ordered_json doc;
  doc["schema"] = "vramscope.snapshot";
  doc["version"] = kSnapshotJsonSchemaVersion;

  ordered_json device;
  if (snapshot.device.info) {
    device["name"] = snapshot.device.info->name;
    device["simulated"] = snapshot.device.info->simulated;
    device["granularity"] = snapshot.device.info->granularity;
    device["assumptions"] = snapshot.device.info->assumptions;
  }
  device["total_bytes"] = snapshot.device.total_bytes;
  device["free_bytes"] = snapshot.device.free_bytes;
  device["free_from_device"] = snapshot.device.free_from_device;
  device["used_bytes"] = snapshot.device.used_bytes;
  device["peak_used_bytes"] = snapshot.device.peak_used_bytes;
  device["context_bytes"] = snapshot.device.context_bytes;
  doc["device"] = device;

  doc["allocator_settings"] = ordered_json{{"conf", snapshot.config.to_string()}};
  doc["memory_stats"] = memory_stats_json(snapshot.stats);

  const Fragmentation frag = fragmentation(snapshot);
  doc["fragmentation"] = ordered_json{
      {"reserved_unallocated_bytes", frag.reserved_unallocated_bytes},
      {"largest_free_block", snapshot.has_segments ? ordered_json(frag.largest_free_block)
                                                   : ordered_json(nullptr)},
      {"free_blocks", snapshot.has_segments ? ordered_json(frag.free_blocks) : ordered_json(nullptr)}};

  if (snapshot.has_segments) {
    ordered_json segments = ordered_json::array();
    for (const SegmentInfo& seg : snapshot.segments) {
      ordered_json blocks = ordered_json::array();
      for (const BlockInfo& b : seg.blocks) {
        ordered_json block{{"address", b.address},
                           {"size", b.size},
                           {"requested_size", b.requested_size},
                           {"state", block_state_name(b.state)}};
        block.update(owner_json(b.context));
        blocks.push_back(std::move(block));
      }
      segments.push_back(ordered_json{{"address", seg.address},
                                      {"total_size", seg.total_size},
                                      {"allocated_size", seg.allocated_size},
                                      {"active_size", seg.active_size},
                                      {"requested_size", seg.requested_size},
                                      {"stream", seg.stream},
                                      {"pool", seg.small_pool ? "small" : "large"},
                                      {"expandable", seg.expandable},
                                      {"blocks", std::move(blocks)}});
    }
    doc["segments"] = std::move(segments);
  }
  if (snapshot.has_history) {
    ordered_json history = ordered_json::array();
    for (const HistoryEntry& e : snapshot.history) {
      ordered_json entry{{"seq", e.sequence},
                         {"time_us", e.time_us},
                         {"action", trace_action_name(e.action)},
                         {"address", e.address},
                         {"size", e.size},
                         {"requested_size", e.requested_size},
                         {"stream", e.stream}};
      entry.update(owner_json(e.context));
      entry["pool"] = e.small_pool ? "small" : "large";
      entry["allocated_bytes"] = e.allocated_bytes;
      entry["reserved_bytes"] = e.reserved_bytes;
      entry["device_used_bytes"] = e.device_used_bytes;
      history.push_back(std::move(entry));
    }
    doc["history"] = std::move(history);
  }
  return doc.dump(indent) + "\n";
}

void write_snapshot_json(const Snapshot& snapshot, const std::filesystem::path& path) {
  write_output_file(path, snapshot_json(snapshot), "mem::write_snapshot_json");
}

}  // namespace mem
