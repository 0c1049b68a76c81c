// exports.hpp — files people already have tools for. Schemas: docs/EXPORTS.md.
//
//   auto s = mem::snapshot(allocator, {.segments = true, .history = true});
//   mem::write_memory_snapshot_pickle(s, "snapshot.pickle");  // pytorch.org/memory_viz
//   mem::write_snapshot_json(s, "snapshot.json");
//   mem::write_history_csv(s.history, "history.csv");
//   mem::write_perfetto_trace(timeline, "trace.json");        // ui.perfetto.dev
//   mem::write_memory_plot_svg(timeline, "memory.svg");
//
// Each `write_*` throws mem::Error naming the path and the reason when the file
// cannot be written; each has a string-returning twin.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/instrumentation/files.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/instrumentation/snapshot.hpp"
#include "vramscope/instrumentation/timeline.hpp"

namespace mem {

/// Schema versions; bumped on any change a reader could notice.
inline constexpr int kSnapshotJsonSchemaVersion = 1;
inline constexpr int kHistoryCsvSchemaVersion = 1;
inline constexpr int kPerfettoSchemaVersion = 1;
inline constexpr int kPickleSchemaVersion = 2;  // 2: trace alloc/free sizes are requests
inline constexpr int kSvgPlotVersion = 1;

/// The CSV header row of write_history_csv (stable; the trace replay reads it).
inline constexpr std::string_view kHistoryCsvHeader =
    "seq,time_us,action,address,size,requested_size,stream,module,phase,"
    "pool,allocated_bytes,reserved_bytes,device_used_bytes";

// --- PyTorch memory snapshot (torch.cuda.memory._snapshot() pickled) --------
/// Pickle protocol 2 of {"segments", "device_traces", "allocator_settings"} with
/// PyTorch's field names. Each allocated block and trace entry gets one synthetic frame
/// {filename: "<module path>", line: 0, name: "<phase>"} (see PickleOptions).
std::string memory_snapshot_pickle(const Snapshot& snapshot, int device_index = 0);
void write_memory_snapshot_pickle(const Snapshot& snapshot, const std::filesystem::path& path,
                                  int device_index = 0);

/// How blocks and trace entries are named in memory_viz, which prints a frame as
/// "filename:line:name": filename is the module path with its class when module_type
/// knows it ("layer1.0.conv1 (Conv2d)"), name the phase; a block outside every module
/// scope gets one frame naming `unscoped` (when not empty) instead of none.
struct PickleOptions {
  int device_index = 0;
  std::function<std::string(std::string_view path)> module_type = {};
  std::string unscoped = {};    ///< label of blocks outside every scope ("" for no frame)
  std::string none_phase = {};  ///< name of Phase::None frames ("" for "none"), e.g. "parameters"
};
std::string memory_snapshot_pickle(const Snapshot& snapshot, const PickleOptions& options);
void write_memory_snapshot_pickle(const Snapshot& snapshot, const std::filesystem::path& path,
                                  const PickleOptions& options);

// --- JSON of a snapshot ---------------------------------------------------
std::string snapshot_json(const Snapshot& snapshot, int indent = 2);
void write_snapshot_json(const Snapshot& snapshot, const std::filesystem::path& path);

// --- CSV of the history ----------------------------------------------------
std::string history_csv(const std::vector<HistoryEntry>& entries);
/// (read back by the replay module: mem::read_history_csv in vramscope/replay/trace_reader.hpp)
void write_history_csv(const std::vector<HistoryEntry>& entries, const std::filesystem::path& path);

// --- Chrome / Perfetto trace JSON -----------------------------------------
std::string perfetto_trace_json(const Timeline& timeline);
void write_perfetto_trace(const Timeline& timeline, const std::filesystem::path& path);

// --- SVG plot ---------------------------------------------------------------
struct PlotOptions {
  int width = 1100;
  int height = 560;
  std::string title;  ///< default: "Memory over time — <device name>"
};
std::string memory_plot_svg(const Timeline& timeline, const PlotOptions& options = {});
/// Text that can sit inside XML/SVG markup, as a text node or an attribute value (every
/// SVG vramscope writes goes through it, the command's sweep plot too).
std::string xml_escape(std::string_view text);
void write_memory_plot_svg(const Timeline& timeline, const std::filesystem::path& path,
                           const PlotOptions& options = {});

}  // namespace mem
