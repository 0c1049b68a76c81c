// allocator_inspect.cpp — looking at the allocator without changing it:
// statistics, the segment listing and validate(), which recomputes every
// statistic from the blocks and checks the structural invariants.
#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "allocator_core.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::detail {

DeviceStats AllocatorCore::stats_locked() const {
  DeviceStats s = stats_;
  pool_stats_.read_into(s);
  s.driver_time_us = device_->driver_time_us();
  return s;
}

DeviceStats AllocatorCore::stats() const {
  std::lock_guard guard(lock_);
  return stats_locked();
}

void AllocatorCore::reset_peak_stats() {
  std::lock_guard guard(lock_);
  stats_.reset_peaks();
  pool_stats_.reset_peaks();
}

void AllocatorCore::reset_accumulated_stats() {
  std::lock_guard guard(lock_);
  stats_.reset_accumulated();
  pool_stats_.reset_accumulated();
}

std::size_t AllocatorCore::block_size(const void* ptr) const {
  std::lock_guard guard(lock_);
  Block* const* found = active_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr || !(*found)->allocated) {
    throw Error("block_size: " + explain_unknown_pointer_locked(reinterpret_cast<std::uintptr_t>(ptr)));
  }
  return (*found)->size;
}

bool AllocatorCore::owns(const void* ptr) const noexcept {
  std::lock_guard guard(lock_);
  Block* const* found = active_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return found != nullptr && (*found)->allocated;
}

std::vector<const Block*> AllocatorCore::all_blocks_locked() const {
  std::vector<const Block*> out;
  const std::vector<const BlockPool*> pools = pools_locked();
  std::size_t count = active_.size();
  for (const BlockPool* pool : pools) count += pool->size();
  out.reserve(count);
  active_.for_each([&](std::uintptr_t, Block* b) { out.push_back(b); });
  for (const BlockPool* pool : pools) pool->for_each([&](const Block* b) { out.push_back(b); });
  return out;
}

std::string AllocatorCore::explain_unknown_pointer_locked(std::uintptr_t ptr) const {
  if (ptr == 0) return "nullptr is not a block of this allocator";
  for (const Block* b : all_blocks_locked()) {
    if (ptr < b->ptr || ptr >= b->ptr + b->size) continue;
    if (ptr == b->ptr) {
      return "pointer " + format_address(ptr) + " was already freed (double free): its " +
             format_bytes(b->size) + " block is " +
             (b->event_count > 0 ? "waiting for stream events" : "in the cache");
    }
    return "pointer " + format_address(ptr) + " lies " + format_bytes(ptr - b->ptr) + " inside the " +
           format_bytes(b->size) + (b->allocated ? " live" : " free") + " block at " + format_address(b->ptr) +
           "; pass the pointer allocate() returned";
  }
  return "pointer " + format_address(ptr) +
         " is in none of this allocator's segments (another allocator or device, or host memory)";
}

namespace {
BlockState state_of(const Block* b) {
  if (b->allocated) return BlockState::ActiveAllocated;
  if (b->event_count > 0) return BlockState::ActivePendingFree;
  return BlockState::Inactive;
}
}  // namespace

void AllocatorCore::validate_expandable_locked() const {
  auto fail = [](const std::string& why) { throw Error("allocator invariant violated: " + why); };
  // Every expandable segment is tiled, base to end, by its blocks; unmapped ones are
  // coalesced, in their pool's unmapped set and over unmapped pages only.
  std::map<std::uint16_t, std::vector<const Block*>> by_segment;
  for (const Block* b : all_blocks_locked()) {
    if (b->expandable()) by_segment[b->segment].push_back(b);
  }
  for (const BlockPool* pool : pools_locked()) {
    for (const Block* b : pool->unmapped) {
      if (b->mapped || !b->expandable() || b->pool != pool) fail("the unmapped set holds a mapped or foreign block");
      if (b->allocated || b->event_count != 0) fail("an unmapped block is active");
      by_segment[b->segment].push_back(b);
    }
  }
  for (std::size_t i = 0; i < expandable_.size(); ++i) {
    const ExpandableSegment* segment = expandable_[i].get();
    auto found = by_segment.find(static_cast<std::uint16_t>(i + 1));
    if (segment == nullptr) {
      if (found != by_segment.end()) fail("blocks of a released expandable segment remain");
      continue;
    }
    if (found == by_segment.end()) fail("an expandable segment has no blocks");
    std::vector<const Block*>& blocks = found->second;
    std::sort(blocks.begin(), blocks.end(), [](const Block* a, const Block* b) { return a->ptr < b->ptr; });
    std::uintptr_t at = segment->base();
    const Block* prev = nullptr;
    for (const Block* b : blocks) {
      if (b->ptr != at || b->prev != prev || (prev != nullptr && prev->next != b)) {
        fail("the blocks of an expandable segment do not tile its addresses");
      }
      if (!b->mapped) {
        if (prev != nullptr && !prev->mapped) fail("two adjacent unmapped blocks were not coalesced");
        if ((b->ptr - segment->base()) % segment->page() != 0 || b->size % segment->page() != 0) {
          fail("an unmapped block is not whole pages");
        }
        if (!segment->pages_are(b->ptr, b->size, false)) fail("an unmapped block has mapped pages");
        if (!b->pool->unmapped.contains(const_cast<Block*>(b))) fail("an unmapped block is missing from its set");
      }
      at = b->ptr + b->size;
      prev = b;
    }
    if (at != segment->base() + segment->size() || prev->next != nullptr) {
      fail("the blocks of an expandable segment do not reach its end");
    }
  }
  for (const auto& [index, blocks] : by_segment) {
    if (index > expandable_.size()) fail("a block names an expandable segment that does not exist");
  }
}

std::vector<SegmentInfo> AllocatorCore::segments(DeviceStats* stats) const {
  std::lock_guard guard(lock_);
  if (stats != nullptr) *stats = stats_locked();
  std::vector<SegmentInfo> out;
  for (const Block* head : all_blocks_locked()) {
    // A segment begins at a block with nothing before it; in an expandable segment, every
    // contiguous mapped range is one (PyTorch's snapshot()).
    if (head->prev != nullptr && head->prev->mapped) continue;
    SegmentInfo seg;
    seg.address = head->ptr;
    seg.stream = head->stream;
    seg.small_pool = head->pool->is_small;
    seg.expandable = head->expandable();
    seg.pool = head->pool->owner != nullptr ? head->pool->owner->id : 0;
    for (const Block* b = head; b != nullptr && b->mapped; b = b->next) {
      BlockInfo info;
      info.address = b->ptr;
      info.size = b->size;
      info.state = state_of(b);
      info.requested_size = info.state == BlockState::Inactive ? 0 : b->requested_size;
      info.context = b->context;
      seg.total_size += b->size;
      if (info.state == BlockState::ActiveAllocated) seg.allocated_size += b->size;
      if (info.state != BlockState::Inactive) {
        seg.active_size += b->size;
        seg.requested_size += b->requested_size;
      }
      seg.blocks.push_back(info);
    }
    out.push_back(std::move(seg));
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

void AllocatorCore::validate() const {
  std::lock_guard guard(lock_);
  auto fail = [](const std::string& why) { throw Error("allocator invariant violated: " + why); };
  const std::vector<const Block*> blocks = all_blocks_locked();
  std::set<const Block*> seen;
  for (const Block* b : blocks) {
    if (!seen.insert(b).second) fail("a block is both active and free, or in a pool twice");
  }

  // Recompute every statistic from the blocks.
  DeviceStats expect;
  std::size_t reserved_rounded = 0;
  std::size_t oversize_allocs = 0, oversize_segs = 0;
  std::size_t pending_events = 0;
  std::map<const PrivatePool*, std::size_t> private_reserved;
  for (const Block* head : blocks) {
    if (head->prev != nullptr && head->prev->mapped) continue;
    const std::size_t pi = static_cast<std::size_t>(head->pool->is_small ? StatType::SmallPool
                                                                          : StatType::LargePool);
    std::size_t total = 0;
    const bool split = head->next != nullptr;
    const bool expandable = head->expandable();
    for (const Block* b = head; b != nullptr && b->mapped; b = b->next) {
      if (!seen.count(b)) fail("a block of a segment is neither active nor pooled");
      if (b->next && b->next->prev != b) fail("broken prev/next links in a segment");
      if (b->next && b->ptr + b->size != b->next->ptr) {
        fail("blocks do not tile their segment (gap or overlap at " + std::to_string(b->ptr) +
             ")");
      }
      if (b->pool != head->pool || b->stream != head->stream || b->segment != head->segment) {
        fail("mixed pools in a segment");
      }
      if (b->size == 0 || b->size % kMinBlockSize != 0) fail("block size not a multiple of 512");
      const bool is_free = !b->allocated && b->event_count == 0;
      const bool in_pool = b->pool->contains(b);
      if (is_free != in_pool) fail("pool membership disagrees with block state");
      if (!is_free && active_.find(b->ptr) == nullptr) fail("active block missing from the map");
      if (is_free && b->next && b->next->mapped && !b->next->allocated && b->next->event_count == 0) {
        fail("two adjacent free blocks were not coalesced");
      }
      total += b->size;
      const auto bytes = static_cast<std::int64_t>(b->size);
      if (b->allocated) {
        expect.allocation[0].current++, expect.allocation[pi].current++;
        expect.allocated_bytes[0].current += bytes, expect.allocated_bytes[pi].current += bytes;
        if (b->size >= config_.max_split_size) ++oversize_allocs;
      }
      if (!is_free) {
        expect.active[0].current++, expect.active[pi].current++;
        expect.active_bytes[0].current += bytes, expect.active_bytes[pi].current += bytes;
        const auto req = static_cast<std::int64_t>(b->requested_size);
        expect.requested_bytes[0].current += req, expect.requested_bytes[pi].current += req;
        pending_events += static_cast<std::size_t>(b->event_count);
      } else if (split && !expandable) {  // PyTorch leaves expandable segments out of inactive_split
        expect.inactive_split[0].current++, expect.inactive_split[pi].current++;
        expect.inactive_split_bytes[0].current += bytes;
        expect.inactive_split_bytes[pi].current += bytes;
      }
    }
    const auto seg_bytes = static_cast<std::int64_t>(total);
    expect.reserved_bytes[0].current += seg_bytes, expect.reserved_bytes[pi].current += seg_bytes;
    if (head->pool->owner != nullptr) private_reserved[head->pool->owner] += total;
    reserved_rounded += device_rounded(total);
    if (expandable) {
      // Mapped pages are reserved memory; the segment count and oversize segments are
      // cudaMalloc's alone (PyTorch's map_block changes neither).
      if (!segment_of(head).pages_are(head->ptr, total, true)) fail("a mapped range has unmapped pages");
      continue;
    }
    expect.segment[0].current++, expect.segment[pi].current++;
    if (total >= config_.max_split_size) ++oversize_segs;
  }
  validate_expandable_locked();
  for (const auto& [id, pool] : private_pools_) {
    if (pool->id != id || pool->large.owner != pool.get() || pool->small.owner != pool.get()) {
      fail("a private pool is filed under another id or its halves name another owner");
    }
    if (pool->reserved != private_reserved[pool.get()]) {
      fail("private pool " + std::to_string(id) + " counts " + std::to_string(pool->reserved) +
           " reserved bytes, its segments hold " + std::to_string(private_reserved[pool.get()]));
    }
    if (pool->use_count < 0) fail("a private pool has fewer than no users");
  }
  for (const auto& [id, stream] : captures_) {
    const auto found = private_pools_.find(id);
    if (found == private_pools_.end() || found->second->use_count == 0) fail("a capture allocates to a pool without users");
  }
  for (const BlockPool* pool : pools_locked()) {
    if (const std::string error = pool->check(); !error.empty()) fail(error);
    std::size_t largest = 0;
    pool->for_each([&](const Block* b) {
      if (b->allocated || b->event_count > 0) fail("an active block sits in a free pool");
      largest = std::max(largest, b->size);
    });
    if (pool->largest_size() != largest) fail("the pool's largest free block is not its largest block");
  }
  std::size_t queued = 0;
  for (const auto& [stream, queue] : events_) queued += queue.size();
  if (queued != pending_events) fail("event queues disagree with blocks' event counts");

  auto check = [&](std::string_view name, const StatArray& got, const StatArray& want) {
    for (std::size_t t = 0; t < kNumStatTypes; ++t) {
      if (got[t].current != want[t].current) {
        fail(std::string(name) + "[" + std::string(kStatTypeNames[t]) + "].current is " +
             std::to_string(got[t].current) + ", blocks say " + std::to_string(want[t].current));
      }
      if (got[t].peak < got[t].current) fail(std::string(name) + " peak below current");
    }
  };
  const DeviceStats got = stats_locked();
#define VRAMSCOPE_CHECK(name) check(#name, got.name, expect.name);
  VRAMSCOPE_STAT_ARRAYS(VRAMSCOPE_CHECK)
#undef VRAMSCOPE_CHECK
  if (static_cast<std::size_t>(stats_.oversize_allocations.current) != oversize_allocs) {
    fail("oversize_allocations disagrees with the blocks");
  }
  if (static_cast<std::size_t>(stats_.oversize_segments.current) != oversize_segs) {
    fail("oversize_segments disagrees with the blocks");
  }
  if (static_cast<std::size_t>(got.reserved_bytes[0].current) != total_reserved_) {
    fail("reserved bytes disagree with the running total");
  }
  if (static_cast<std::size_t>(stats_.device_used_bytes.current) !=
      context_bytes_ + reserved_rounded) {
    fail("device view is not context + segments at driver granularity");
  }
}

}  // namespace mem::detail
