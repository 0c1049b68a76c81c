// export_pickle.cpp — a snapshot as torch.cuda.memory._snapshot() pickles it,
// so pytorch.org/memory_viz and torch/cuda/_memory_viz.py read it.
#include <fmt/format.h>

#include "pickle_writer.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/instrumentation/exports.hpp"

namespace mem {
namespace {

// One synthetic frame per context: memory_viz prints frames as "filename:line:name", so
// the module (and its class, when known) and the phase show where a stack would.
void frames(detail::PickleWriter& w, ContextId context, const PickleOptions& options) {
  w.begin_list();
  if (context != kNoContext) {
    const ContextInfo& info = context_info(context);
    std::string module = info.path.empty() ? std::string("step") : info.path;
    if (options.module_type) {
      if (const std::string type = options.module_type(info.path); !type.empty()) {
        module += " (" + type + ")";
      }
    }
    w.begin_dict();
    w.item("filename", module);
    w.item("line", std::int64_t{0});
    w.item("name", info.phase == Phase::None && !options.none_phase.empty()
                       ? options.none_phase
                       : std::string(phase_name(info.phase)));
    w.end_dict();
  } else if (!options.unscoped.empty()) {
    w.begin_dict();
    w.item("filename", options.unscoped);
    w.item("line", std::int64_t{0});
    w.item("name", "none");
    w.end_dict();
  }
  w.end_list();
}

void segment(detail::PickleWriter& w, const SegmentInfo& seg, const PickleOptions& options) {
  const int device_index = options.device_index;
  w.begin_dict();
  w.item("device", std::int64_t{device_index});
  w.item_u("address", seg.address);
  w.item_u("total_size", seg.total_size);
  w.item_u("allocated_size", seg.allocated_size);
  w.item_u("active_size", seg.active_size);
  w.item_u("requested_size", seg.requested_size);
  w.item_u("stream", seg.stream);
  w.item("segment_type", seg.small_pool ? "small" : "large");
  // PyTorch's MempoolId_t: (0, 0) the default pools, (0, n) graph_pool_handle()'s n-th pool.
  w.string("segment_pool_id");
  w.integer(0);
  w.integer(static_cast<std::int64_t>(seg.pool));
  w.tuple2();
  w.item("is_expandable", seg.expandable);
  w.string("frames");
  frames(w, kNoContext, PickleOptions{});  // a segment has no owner of its own
  w.string("blocks");
  w.begin_list();
  for (const BlockInfo& block : seg.blocks) {
    w.begin_dict();
    w.item_u("address", block.address);
    w.item_u("size", block.size);
    w.item_u("requested_size", block.requested_size);
    w.item("state", block_state_name(block.state));
    w.string("frames");
    if (block.state == BlockState::Inactive) {
      frames(w, kNoContext, PickleOptions{});  // free: nobody's
    } else {
      frames(w, block.context, options);
    }
    w.end_dict();
  }
  w.end_list();
  w.end_dict();
}

void trace_entry(detail::PickleWriter& w, const HistoryEntry& e, std::size_t device_free,
                 const PickleOptions& options) {
  w.begin_dict();
  w.item("action", trace_action_name(e.action));
  // PyTorch stores cudaMemGetInfo's free under "device_free" for an oom, not "addr".
  if (e.action == TraceAction::Oom) {
    w.item_u("device_free", device_free);
  } else {
    w.item_u("addr", e.address);
  }
  // PyTorch records orig_size (the caller's request) for alloc/free entries, not the block size.
  const bool block_event = e.action == TraceAction::Alloc ||
                           e.action == TraceAction::FreeRequested ||
                           e.action == TraceAction::FreeCompleted;
  w.item_u("size", block_event && e.requested_size > 0 ? e.requested_size : e.size);
  w.item_u("stream", e.stream);
  w.item("time_us", static_cast<std::int64_t>(e.time_us));
  w.string("frames");
  frames(w, e.context, options);
  w.end_dict();
}

void allocator_settings(detail::PickleWriter& w, const AllocatorConfig& config) {
  w.begin_dict();
  w.item("PYTORCH_CUDA_ALLOC_CONF", config.to_string());
  // PyTorch casts size_t max ("no limit") to int64, i.e. -1.
  w.item("max_split_size", static_cast<std::int64_t>(config.max_split_size));
  w.item("garbage_collection_threshold", config.garbage_collection_threshold);
  w.item("expandable_segments", config.expandable_segments);
  w.item("pinned_num_register_threads", std::int64_t{1});
  w.item("release_lock_on_cudamalloc", false);
  w.item("pinned_use_cuda_host_register", false);
  w.string("roundup_power2_divisions");
  w.begin_dict();
  std::uint64_t key = 1;
  for (std::size_t divisions : config.roundup_power2_divisions) {
    w.item_u(std::to_string(key), divisions);
    key *= 2;
  }
  w.end_dict();
  w.end_dict();
}

}  // namespace

std::string memory_snapshot_pickle(const Snapshot& snapshot, int device_index) {
  return memory_snapshot_pickle(snapshot, PickleOptions{.device_index = device_index});
}

std::string memory_snapshot_pickle(const Snapshot& snapshot, const PickleOptions& options) {
  const int device_index = options.device_index;
  if (device_index < 0) throw Error("pickle export: device_index must be >= 0");
  if (!snapshot.has_segments && !snapshot.has_history) {
    throw Error(
        "pickle export: the snapshot has neither segments nor history; take it with "
        "mem::snapshot(allocator, {.segments = true, .history = true})");
  }
  detail::PickleWriter w;
  w.begin_dict();
  w.string("segments");
  w.begin_list();
  for (const SegmentInfo& seg : snapshot.segments) segment(w, seg, options);
  w.end_list();

  // One trace list per device up to ours; memory_viz indexes them by device.
  w.string("device_traces");
  w.begin_list();
  for (int d = 0; d < device_index; ++d) {
    w.begin_list();
    w.end_list();
  }
  w.begin_list();
  for (const HistoryEntry& e : snapshot.history) trace_entry(w, e, snapshot.device.free_bytes, options);
  w.end_list();
  w.end_list();

  w.string("allocator_settings");
  allocator_settings(w, snapshot.config);
  w.end_dict();
  return w.finish();
}

void write_memory_snapshot_pickle(const Snapshot& snapshot, const std::filesystem::path& path,
                                  int device_index) {
  write_memory_snapshot_pickle(snapshot, path, PickleOptions{.device_index = device_index});
}

void write_memory_snapshot_pickle(const Snapshot& snapshot, const std::filesystem::path& path,
                                  const PickleOptions& options) {
  write_output_file(path, memory_snapshot_pickle(snapshot, options),
                     "mem::write_memory_snapshot_pickle");
}

}  // namespace mem
