// block.hpp — one block of a segment (internal).
//
// As in PyTorch's DeviceCachingAllocator, a segment is one device allocation
// tiled by Blocks linked prev/next. An expandable segment is one reserved
// address range tiled the same way, by mapped blocks and unmapped ones (which
// sit in their pool's `unmapped` set, never in its size classes). A free Block sits in exactly one BlockPool
// (block_pool.hpp), linked into its size class's tree; an active one
// (allocated, or freed but waiting for stream events) sits in the allocator's
// address map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vramscope/allocator/caching_allocator.hpp"

namespace mem::detail {

class BlockPool;

/// The first cache line holds what splitting, coalescing and the pool touch on
/// a neighbour, its place in its size class's tree included; the second what
/// only the block's own allocation and free use, so a neighbour costs one line.
struct alignas(64) Block {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;            // bytes of this block (a multiple of 512)
  Block* prev = nullptr;           // neighbours inside the segment
  Block* next = nullptr;           // (also the free-list link while released to the pool)
  Block* tree_parent = nullptr;    // its place in its pool's size class while free
  Block* tree_child[2] = {};       // (block_tree.hpp): smaller keys at [0], larger at [1]
  int event_count = 0;             // outstanding events before reuse
  bool allocated = false;
  bool tree_red = false;
  std::uint16_t pool_class = 0;    // its size class in the pool while free
  // --- second line
  StreamId stream = 0;             // the stream whose pool owns the segment
  BlockPool* pool = nullptr;
  std::size_t requested_size = 0;        // caller's size while active
  std::vector<StreamId> stream_uses;     // streams from record_stream (only while allocated)
  std::uint32_t context = 0;
  std::uint16_t segment = 0;             // expandable segment: its index + 1; 0: a cudaMalloc segment
  bool mapped = true;                    // false: unmapped address space of an expandable segment
  std::uint64_t gc_count_base = 0;       // pool's call count when it was freed (GC only)

  bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
  bool expandable() const noexcept { return segment != 0; }
  /// Free and mergeable: not handed out and no pending events (stream uses exist
  /// only while allocated: free() turns them into events).
  bool is_free() const noexcept { return !allocated && event_count == 0; }
};
static_assert(offsetof(Block, pool_class) + sizeof(std::uint16_t) <= 64,
              "what a neighbour's split and merge touch stays in the first cache line");
static_assert(sizeof(Block) == 128, "two cache lines");

}  // namespace mem::detail
