// summary.hpp — memory_summary(): torch.cuda.memory_summary()'s table, plus the
// rows PyTorch lacks (nvidia-smi view, CUDA context, fragmentation).
#pragma once

#include <string>

#include "vramscope/instrumentation/snapshot.hpp"

namespace mem {

struct SummaryOptions {
  bool abbreviated = false;  ///< omit the "from large pool" / "from small pool" rows
  int device_index = 0;      ///< the "device ID" in the title
};

/// The summary of a snapshot. Fragmentation needs segments (snapshot taken with
/// .segments = true); without them its row shows what the statistics allow.
std::string memory_summary(const Snapshot& snapshot, SummaryOptions options = {});
/// The summary of an allocator (takes a snapshot with segments).
std::string memory_summary(const CachingAllocator& allocator, SummaryOptions options = {});
/// The summary of process_allocator().
std::string memory_summary(SummaryOptions options = {});

}  // namespace mem
