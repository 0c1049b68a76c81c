// reference_model.cpp — the contract, checked from the outside: the model only
// uses the public API (segments(), stats(), the SimDevice's counters) and its
// own record of what was handed out, so a bug the allocator's validate() shares
// with its own bookkeeping still shows up here.
#include "reference_model.hpp"

#include <algorithm>

#include "vramscope/allocator/units.hpp"

namespace mem::reliability {
namespace {


std::string block_name(std::uintptr_t address, std::size_t size) {
  return "block " + format_address(address) + " (" + std::to_string(size) + " B)";
}

[[noreturn]] void fail(const std::string& why) {
  throw ReferenceViolation("reference model: " + why);
}

void expect_eq(const char* what, std::int64_t got, std::int64_t want) {
  if (got != want) {
    fail(std::string(what) + " is " + std::to_string(got) + ", the model says " +
         std::to_string(want));
  }
}

std::size_t pool_index(std::size_t rounded) { return rounded <= kSmallSize ? 1 : 2; }

}  // namespace

ReferenceModel::ReferenceModel(AllocatorConfig config, SimDeviceConfig device)
    : config_(config), device_(std::move(device)) {}

std::size_t ReferenceModel::device_pages_bytes(std::size_t bytes) const noexcept {
  const std::size_t g = device_.granularity == 0 ? 1 : device_.granularity;
  return (bytes + g - 1) / g * g;
}

std::size_t ReferenceModel::pinned_reserved(const std::vector<SegmentInfo>& segments) {
  std::size_t pinned = 0;
  for (const SegmentInfo& seg : segments) {
    if (seg.allocated_size > 0) pinned += seg.total_size;
  }
  return pinned;
}

void ReferenceModel::on_allocate(const void* ptr, std::size_t requested, std::size_t block_size,
                                 StreamId stream) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  if (ptr == nullptr) fail("allocate(" + std::to_string(requested) + ") returned nullptr");
  if (address % kMinBlockSize != 0)
    fail("allocate returned a pointer not 512-aligned: " + format_address(address));
  const std::size_t rounded = round_size(requested, config_);
  if (rounded < requested || rounded % kMinBlockSize != 0) {
    fail("round_size(" + std::to_string(requested) + ") = " + std::to_string(rounded) +
         " is not a multiple of 512 at least the request");
  }
  // The block may exceed the rounded size only when the rest was too small to split:
  // never in the small pool (everything is a multiple of 512), at most 1 MiB in the
  // large pool, and for oversize requests less than max_non_split_rounding_size or the
  // 2 MiB rounding of their own segment.
  std::size_t max_waste = 0;
  if (rounded > kSmallSize) {
    max_waste = rounded < config_.max_split_size
                    ? kSmallSize
                    : std::max(config_.max_non_split_rounding_size, kRoundLarge) - 1;
  }
  if (block_size < rounded || block_size - rounded > max_waste) {
    fail("allocate(" + std::to_string(requested) + ") gave a " + std::to_string(block_size) +
         " B block; round_size says " + std::to_string(rounded) + " B and at most " +
         std::to_string(max_waste) + " B may be left unsplit");
  }
  const auto next = blocks_.lower_bound(address);
  if (next != blocks_.end() && next->first < address + block_size) {
    fail("new " + block_name(address, block_size) + " overlaps the " +
         (next->second.live ? "live " : "pending ") + block_name(next->first, next->second.size));
  }
  if (next != blocks_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second.size > address) {
      fail("new " + block_name(address, block_size) + " overlaps the " +
           (prev->second.live ? "live " : "pending ") + block_name(prev->first, prev->second.size));
    }
  }
  Block b;
  b.requested = requested;
  b.rounded = rounded;
  b.size = block_size;
  b.stream = stream;
  blocks_.emplace_hint(next, address, std::move(b));
  ++live_count_;
}

ReferenceModel::Block& ReferenceModel::live_block(const void* ptr, const char* what) {
  const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == blocks_.end() || !it->second.live) {
    fail(std::string(what) + " of " + format_address(reinterpret_cast<std::uintptr_t>(ptr)) +
         ", which the model does not hold live (a harness bug)");
  }
  return it->second;
}

void ReferenceModel::on_record_stream(const void* ptr, StreamId stream) {
  Block& b = live_block(ptr, "record_stream");
  if (stream == b.stream) return;  // its own stream orders the reuse already
  if (std::find(b.uses.begin(), b.uses.end(), stream) == b.uses.end()) b.uses.push_back(stream);
}

void ReferenceModel::on_free(const void* ptr) {
  Block& b = live_block(ptr, "free");
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  --live_count_;
  if (b.uses.empty()) {
    blocks_.erase(address);
    return;
  }
  int events = 0;
  bool synchronized = false;
  for (StreamId s : b.uses) {
    if (destroyed_.contains(s)) {
      // The device synchronizes once: every event recorded so far completes
      // (blocks behind them are reclaimed at the next event processing).
      if (!synchronized) on_release_events();
      synchronized = true;
      continue;
    }
    events_[s].push_back(Event{address, !held_});
    ++events;
  }
  b.uses.clear();
  if (events == 0) {
    blocks_.erase(address);
    return;
  }
  b.live = false;
  b.pending_events = events;
}

void ReferenceModel::complete_block(std::uintptr_t address) {
  const auto it = blocks_.find(address);
  if (it != blocks_.end() && --it->second.pending_events == 0) blocks_.erase(it);
}

void ReferenceModel::process_events() {
  for (auto it = events_.begin(); it != events_.end();) {
    auto& queue = it->second;
    while (!queue.empty() && queue.front().complete) {
      const std::uintptr_t address = queue.front().block;
      queue.pop_front();
      complete_block(address);
    }
    it = queue.empty() ? events_.erase(it) : std::next(it);
  }
}

void ReferenceModel::synchronize_all() {
  for (auto& [stream, queue] : events_) {
    for (Event& e : queue) e.complete = true;
  }
  process_events();
}

void ReferenceModel::on_allocate_attempt(bool synchronized) {
  process_events();
  if (synchronized) synchronize_all();
}

void ReferenceModel::on_release_events() {
  for (auto& [stream, queue] : events_) {
    for (Event& e : queue) e.complete = true;
  }
}

void ReferenceModel::on_empty_cache() { synchronize_all(); }

void ReferenceModel::check(const CachingAllocator& alloc, const SimDevice& device) const {
  const DeviceStats st = alloc.stats();
  const std::vector<SegmentInfo> segments = alloc.segments();

  // Every model block lies inside one reported segment (both lists are sorted).
  auto seg = segments.begin();
  for (const auto& [address, b] : blocks_) {
    while (seg != segments.end() && seg->address + seg->total_size <= address) ++seg;
    if (seg == segments.end() || address < seg->address ||
        address + b.size > seg->address + seg->total_size) {
      fail(std::string(b.live ? "live " : "pending ") + block_name(address, b.size) +
           " lies in none of the allocator's segments");
    }
  }

  // Walk the allocator's blocks: each active one is the model's, each free one is not.
  std::size_t reserved = 0, reserved_small = 0, pages = 0, small_segments = 0;
  std::size_t seen_live = 0, seen_pending = 0;
  std::uintptr_t prev_end = 0;
  for (const SegmentInfo& s : segments) {
    if (s.address < prev_end) fail("segment " + format_address(s.address) + " overlaps the one before");
    std::uintptr_t at = s.address;
    for (const BlockInfo& info : s.blocks) {
      if (info.address != at) {
        fail("blocks do not tile segment " + format_address(s.address) + ": expected a block at " + format_address(at) +
             ", found " + format_address(info.address));
      }
      at += info.size;
      const auto it = blocks_.find(info.address);
      const bool known = it != blocks_.end();
      if (info.state == BlockState::Inactive) {
        if (known) {
          fail("the model's " + std::string(it->second.live ? "live " : "pending ") +
               block_name(info.address, it->second.size) + " is free in the allocator");
        }
        continue;
      }
      const bool live = info.state == BlockState::ActiveAllocated;
      if (!known || it->second.live != live) {
        fail("the allocator shows " + std::string(live ? "live " : "pending ") +
             block_name(info.address, info.size) + " that the model has as " +
             (!known            ? "free"
              : it->second.live ? "live"
                                : "pending"));
      }
      const Block& b = it->second;
      if (info.size != b.size || info.requested_size != b.requested) {
        fail(block_name(info.address, info.size) + " asked for " +
             std::to_string(info.requested_size) + " B; the model has " + std::to_string(b.size) +
             " B asked for " + std::to_string(b.requested) + " B");
      }
      if (s.stream != b.stream) {
        fail(block_name(info.address, info.size) + " was allocated on stream " +
             std::to_string(b.stream) + " but sits in a segment of stream " +
             std::to_string(s.stream));
      }
      if (s.small_pool != (pool_index(b.rounded) == 1)) {
        fail(block_name(info.address, info.size) + " (rounded " + std::to_string(b.rounded) +
             " B) sits in the wrong pool's segment");
      }
      ++(live ? seen_live : seen_pending);
    }
    if (at - s.address != s.total_size) {
      fail("segment " + format_address(s.address) + " reports " + std::to_string(s.total_size) +
           " B but its blocks add up to " + std::to_string(at - s.address) + " B");
    }
    prev_end = at;
    reserved += s.total_size;
    pages += device_pages_bytes(s.total_size);
    if (s.small_pool) {
      reserved_small += s.total_size;
      ++small_segments;
    }
  }
  if (seen_live != live_count_ || seen_pending != pending_count()) {
    fail("the segments hold " + std::to_string(seen_live) + " live and " +
         std::to_string(seen_pending) + " pending blocks; the model has " +
         std::to_string(live_count_) + " and " + std::to_string(pending_count()));
  }

  // Statistics, recomputed from the model's own record.
  std::int64_t count[3] = {}, allocated[3] = {}, active[3] = {}, active_bytes[3] = {},
               requested[3] = {};
  for (const auto& [address, b] : blocks_) {
    for (const std::size_t pi : {std::size_t{0}, pool_index(b.rounded)}) {
      if (b.live) {
        ++count[pi];
        allocated[pi] += static_cast<std::int64_t>(b.size);
      }
      ++active[pi];
      active_bytes[pi] += static_cast<std::int64_t>(b.size);
      requested[pi] += static_cast<std::int64_t>(b.requested);
    }
  }
  for (std::size_t pi = 0; pi < kNumStatTypes; ++pi) {
    const auto stat = [&](std::string_view name, const StatArray& got, std::int64_t want) {
      if (got[pi].current == want) return;
      std::string what(name);
      what.append("[").append(kStatTypeNames[pi]).append("]");
      expect_eq(what.c_str(), got[pi].current, want);
    };
    stat("allocation", st.allocation, count[pi]);
    stat("allocated_bytes", st.allocated_bytes, allocated[pi]);
    stat("active", st.active, active[pi]);
    stat("active_bytes", st.active_bytes, active_bytes[pi]);
    stat("requested_bytes", st.requested_bytes, requested[pi]);
  }
  const auto i64 = [](std::size_t v) { return static_cast<std::int64_t>(v); };
  expect_eq("reserved_bytes[all]", st.reserved_bytes[0].current, i64(reserved));
  expect_eq("reserved_bytes[small_pool]", st.reserved_bytes[1].current, i64(reserved_small));
  expect_eq("segment[all]", st.segment[0].current, i64(segments.size()));
  expect_eq("segment[small_pool]", st.segment[1].current, i64(small_segments));

  // The device agrees: what it handed out is what the allocator reserved.
  expect_eq("SimDevice::used_bytes()", i64(device.used_bytes()), i64(reserved));
  const std::size_t used = device_.context_bytes + pages;
  expect_eq("SimDevice::process_used_bytes()", i64(device.process_used_bytes()), i64(used));
  expect_eq("device_used_bytes", st.device_used_bytes.current, i64(used));
  const DeviceMemInfo mem = device.mem_get_info();
  expect_eq("mem_get_info().total", i64(mem.total_bytes), i64(device_.capacity));
  expect_eq("mem_get_info().free", i64(mem.free_bytes), i64(device_.capacity - used));
}

}  // namespace mem::reliability
