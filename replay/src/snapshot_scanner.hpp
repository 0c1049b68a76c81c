// snapshot_scanner.hpp — the fast path for PyTorch snapshot pickles (internal).
//
// A snapshot of a long run is a million small dicts (the trace entries, and the
// segments' blocks of a run that holds much) around a little else. The generic reader
// builds a PickleValue per key and value of each, which dominates loading. The scanner
// runs the same opcodes over a lean value model and turns each trace entry into a
// RecordedEvent, each block into a ScannedBlock, the moment its dict is filled; only
// the rest (segments, settings, the shared frames lists) becomes PickleValues. It knows only what Python's pickler writes for a snapshot: on
// anything else (other opcodes, a trace entry it cannot read, sharing it does not
// expect) it gives up and the caller runs the generic reader, which also reports
// errors with their path. So it never reports an error of its own.
#pragma once

#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>
#include <string_view>
#include <vector>

#include "vramscope/replay/pickle_reader.hpp"
#include "vramscope/replay/trace_reader.hpp"

namespace mem::detail {

/// A segment's block as the snapshot holds it (read_segment places those without an address).
struct ScannedBlock {
  RecordedBlock block;
  bool has_address = false;
  bool filled = false;  // the scanner's: its fields were read
};

struct ScannedSnapshot {
  /// The pickle's root, with each device_traces[d] an empty list (the events are below).
  PickleValue root;
  /// Every trace entry, GPU after GPU; an event's `stack` is 1 + an index into `frames`
  /// (0: none). device_traces[d]'s are events[first, first + count) of device_ranges[d].
  std::vector<RecordedEvent> events;
  std::vector<std::pair<std::size_t, std::size_t>> device_ranges;
  /// The frames lists the events name, each once (the pickle's memo shares them).
  std::vector<PickleValue> frames;
  /// Each segment's blocks, under the identity of its (empty) "blocks" list in `root`.
  std::unordered_map<const void*, std::vector<ScannedBlock>> blocks;
};

/// nullopt: not a snapshot the fast path reads (the caller falls back). `progress`, when
/// given, is told every few MiB how far the scan has read (a mapped file gives back the
/// pages before that; views into them stay valid).
std::optional<ScannedSnapshot> scan_snapshot(std::string_view pickle,
                                             const std::function<void(const char*)>& progress = {});

}  // namespace mem::detail
