// trace_reader.hpp — recorded allocation traces from other tools, in one shape.
//
//   mem::AllocationTrace trace = mem::load_trace("snapshot.pickle");  // any format
//   for (const mem::RecordedEvent& e : trace.events) ...
//
// Formats:
//   - PyTorch memory snapshots (torch.cuda.memory._dump_snapshot): a dict with
//     "segments" (the final state) and "device_traces" (alloc, free_requested,
//     free_completed, segment_alloc, segment_free, segment_map/unmap, oom,
//     snapshot), and the older memory_snapshot() list of segments (no trace).
//   - vramscope's history CSV: seq,time_us,action,address,size,requested_size,
//     stream,module,phase.
//   - RMM's logging_resource_adaptor CSV: Thread,Time,Action,Pointer,Size,Stream.
// Malformed input throws mem::Error naming the file and the line (CSV) or the
// byte offset / event index (pickle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/instrumentation/history.hpp"
#include "vramscope/replay/pickle_reader.hpp"

namespace mem {

/// What happened, in PyTorch's TraceEntry vocabulary plus the expandable-segment
/// and snapshot markers a snapshot may hold.
enum class RecordedAction : std::uint8_t {
  Alloc,          ///< a block was handed out; size is the caller's request
  FreeRequested,  ///< the caller freed it
  FreeCompleted,  ///< the block is back in its pool (stream events done)
  SegmentAlloc,   ///< cudaMalloc of a segment
  SegmentFree,    ///< cudaFree of a segment
  SegmentMap,     ///< expandable segments: pages mapped
  SegmentUnmap,   ///< expandable segments: pages unmapped
  Oom,            ///< an allocation failed
  Snapshot,       ///< a snapshot was taken (no effect on memory)
};
/// PyTorch's name: "alloc", "free_requested", ..., "snapshot".
std::string_view recorded_action_name(RecordedAction action) noexcept;

/// One event of a trace, in the order recorded.
struct RecordedEvent {
  RecordedAction action = RecordedAction::Alloc;
  std::uint32_t stack = 0;  ///< AllocationTrace::stacks[stack - 1]; 0: no frames recorded
  std::uintptr_t address = 0;
  /// Alloc/free: the caller's requested size (block size where the format has
  /// no request); segment events: the segment size; oom: the size asked for.
  std::size_t size = 0;
  std::uint64_t stream = 0;  ///< the recorder's stream handle (0: default stream)
  double time_us = 0;        ///< 0 where the format has no time
};

/// A block of a recorded segment (final state of a snapshot).
struct RecordedBlock {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  BlockState state = BlockState::Inactive;
};

/// A segment of a snapshot's final state, blocks in address order.
struct RecordedSegment {
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  std::uint64_t stream = 0;
  bool small_pool = false;
  bool expandable = false;
  int device = 0;
  std::vector<RecordedBlock> blocks;
};

enum class TraceFormat : std::uint8_t {
  PyTorchSnapshot,     ///< dict with segments and device_traces
  PyTorchSegmentList,  ///< the older list of segments, no trace
  HistoryCsv,          ///< vramscope's history export
  RmmCsv,              ///< RMM logging_resource_adaptor
};
std::string_view trace_format_name(TraceFormat format) noexcept;

/// One device's recorded events and, for snapshots, its final segments.
struct AllocationTrace {
  std::string source;  ///< file name or caller's label, for messages
  TraceFormat format = TraceFormat::PyTorchSnapshot;
  int device = 0;
  std::vector<RecordedEvent> events;
  /// Final state (snapshots only): the segments when the snapshot was taken.
  bool has_final_state = false;
  std::vector<RecordedSegment> final_segments;
  /// The trace holds free_completed events (deallocation waits for them).
  bool has_free_completed = false;
  /// Recorded with expandable segments (segment_map/unmap, is_expandable).
  bool expandable_segments = false;
  /// PYTORCH_CUDA_ALLOC_CONF as recorded ("" when default or unknown).
  std::string allocator_conf;
  bool allocator_conf_known = false;  ///< the snapshot carried allocator_settings

  /// The events' call stacks (snapshots with frames), each distinct one once, as the
  /// snapshot's pickle shares them: "forward (model.py:42) <- ..." innermost first, at most
  /// kStackFrames frames and kStackChars characters, the user's Python frames when there
  /// are any (not the allocator's C++ frames, not torch's own Python).
  std::vector<std::string> stacks;
  static constexpr std::size_t kStackFrames = 4;
  static constexpr std::size_t kStackChars = 256;

  /// Counts of events per action, indexed by RecordedAction.
  std::vector<std::size_t> action_counts() const;
};

/// Interprets a parsed snapshot pickle. `device` -1 picks the device with the
/// most trace events (device 0 when no trace). Throws mem::Error naming the
/// element that is malformed (e.g. "device_traces[0][17].size: expected int").
AllocationTrace read_pytorch_snapshot(const PickleValue& root, int device = -1,
                                      const std::string& source = "snapshot");
AllocationTrace read_pytorch_snapshot_file(const std::string& path, int device = -1);

/// Parses vramscope's history CSV (header required). Errors name the line.
AllocationTrace read_history_trace(std::istream& in, const std::string& source = "history.csv");
AllocationTrace read_history_trace_file(const std::string& path);
/// Reads a file written by write_history_csv back whole, as HistoryEntry (the module column
/// is interned again): the exact header (kHistoryCsvHeader) required. Throws mem::Error
/// naming the file and the line on malformed input.
std::vector<HistoryEntry> read_history_csv(const std::filesystem::path& path);

/// Parses RMM's logging CSV (header required; Time as seconds or HH:MM:SS:us).
AllocationTrace read_rmm_log(std::istream& in, const std::string& source = "rmm.csv");
AllocationTrace read_rmm_log_file(const std::string& path);

/// Detects the format from the content (pickle magic, CSV header) and reads it.
AllocationTrace load_trace(const std::string& path, int device = -1);

}  // namespace mem
