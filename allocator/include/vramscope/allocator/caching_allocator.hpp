// caching_allocator.hpp — a block-pool caching allocator with PyTorch's
// CUDACachingAllocator policy, on any mem::Device.
//
//   auto device = mem::make_device("sim:a100-80g");
//   mem::CachingAllocator alloc{device};
//   void* p = alloc.allocate(5 * mem::MiB);   // reserves a 20 MiB segment
//   alloc.deallocate(p);                      // cached, not returned to the device
//   alloc.stats().reserved_bytes[0].current;  // 20 MiB
//
// Policy (see docs/ARCHITECTURE.md): sizes round to 512 B; requests up to
// 1 MiB use the small pool (2 MiB segments), larger ones the large pool (20 MiB
// segments under 10 MiB, else the request rounded to 2 MiB); best fit by
// (stream, size, address); split and coalesce; record_stream defers reuse;
// on device OOM free the cache and retry once, then throw OutOfMemoryError.
// With expandable_segments:True, each stream and pool has one segment that maps
// pages into reserved address space as it grows and unmaps free pages on
// empty_cache and before the retry (PyTorch's ExpandableSegment).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/allocator/event_ring.hpp"
#include "vramscope/allocator/stats.hpp"

namespace mem {

/// A private memory pool's id (PyTorch's MempoolId_t, whose second half graph_pool_handle()
/// counts from 1); 0 is the default pools.
using PoolId = std::uint64_t;

/// State of a block as PyTorch's snapshot names it.
enum class BlockState : std::uint8_t {
  ActiveAllocated,    ///< "active_allocated": handed out
  ActivePendingFree,  ///< "active_pending_free": freed, waiting for stream events
  Inactive,           ///< "inactive": free in its pool
};
std::string_view block_state_name(BlockState state) noexcept;

struct BlockInfo {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;  ///< caller's size (0 when inactive)
  BlockState state = BlockState::Inactive;
  std::uint32_t context = 0;       ///< context id at allocation (0: none)
};

struct SegmentInfo {
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;  ///< bytes in ActiveAllocated blocks
  std::size_t active_size = 0;     ///< allocated + pending free
  std::size_t requested_size = 0;  ///< sum of requested sizes of active blocks
  StreamId stream = 0;
  bool small_pool = false;
  /// Part of an expandable segment: one contiguous mapped range of it, as PyTorch's
  /// snapshot reports them (is_expandable); total_size is the mapped bytes.
  bool expandable = false;
  PoolId pool = 0;                 ///< the private pool it belongs to (0: the default pools)
  std::vector<BlockInfo> blocks;   ///< in address order, tiling the segment
};

namespace detail {
class AllocatorCore;
}

class CachingAllocator {
 public:
  explicit CachingAllocator(std::shared_ptr<Device> device, AllocatorConfig config = {});
  ~CachingAllocator();  ///< returns every segment to the device
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `bytes` for use on `stream`.
  /// Throws mem::Error for 0 or absurd sizes (nothing changes), OutOfMemoryError
  /// when the device cannot supply it even after the cache was freed.
  void* allocate(std::size_t bytes, StreamId stream = 0);
  /// Returns a block; nullptr is a no-op, as in PyTorch. Throws mem::Error for a pointer
  /// this allocator did not hand out or already took back (double free); the state is
  /// then unchanged.
  void deallocate(void* ptr);
  /// The block is also used on `stream`: its reuse waits for that stream's work.
  void record_stream(void* ptr, StreamId stream);
  /// Gives the live block at `ptr` a new owner context: what the memory is now, not who
  /// asked for it (a gradient AccumulateGrad stole into a parameter's .grad). Snapshots
  /// and histories show the new owner from the block's allocation on; statistics do not
  /// change. Returns false, changing nothing, when `ptr` is not a live block's address.
  bool relabel(const void* ptr, std::uint32_t context) noexcept;

  /// Returns every unsplit free segment to the device (torch.cuda.empty_cache), those of
  /// private pools nobody uses any more included.
  void empty_cache();

  // --- private pools (CUDA graphs, c10::cuda::CUDACachingAllocator's PrivatePool) --------
  // A capture (torch.cuda.graph, inductor's CUDA graph trees) sends the blocks its stream asks
  // for to a pool of its own: its own segments, which no other allocation shares and
  // empty_cache keeps while anyone uses the pool.
  //
  //   mem::PoolId pool = alloc.graph_pool_handle();
  //   alloc.begin_allocate_to_pool(pool, graph_stream);  // the pool is made, one user
  //   void* p = alloc.allocate(4 * mem::MiB, graph_stream);  // a segment of the pool
  //   alloc.end_allocate_to_pool(pool);
  //   alloc.release_pool(pool);  // no user: empty_cache may now give its free segments back

  /// A new pool id (torch.cuda.graph_pool_handle()); the pool is made by its first
  /// begin_allocate_to_pool.
  PoolId graph_pool_handle() noexcept;
  /// From now on, blocks asked for on `stream` come from private pool `pool` (beginAllocateToPool):
  /// made with one user when new, one user more otherwise. Throws mem::Error, changing nothing,
  /// for pool 0, a pool no handle named, a released pool, or one already allocated to.
  void begin_allocate_to_pool(PoolId pool, StreamId stream);
  /// Allocations on the stream go to the default pools again (endAllocateToPool). Throws
  /// mem::Error, changing nothing, when `pool` is not being allocated to.
  void end_allocate_to_pool(PoolId pool);
  /// One user fewer (releasePool): with none left, empty_cache and the out-of-memory retry give
  /// its free segments back, and the pool goes once it holds none. Throws mem::Error, changing
  /// nothing, for a pool that does not exist or has no user left.
  void release_pool(PoolId pool);
  /// Bytes of the segments of private pools (part of reserved_bytes) and of their live blocks
  /// (part of allocated_bytes).
  std::size_t private_pool_reserved() const;
  std::size_t private_pool_allocated() const;
  /// Caps this allocator at fraction * device total (set_per_process_memory_fraction).
  void set_memory_fraction(double fraction);
  /// A library's kernels loaded on the device (`name`: "cuBLAS", "cuDNN"): `bytes` outside
  /// the allocator that the nvidia-smi view counts from now on (Device::load_module).
  /// Throws OutOfMemoryError, changing nothing, when the device has no room for them.
  void load_module(std::string_view name, std::size_t bytes);

  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  /// Every segment with its blocks, in address order.
  std::vector<SegmentInfo> segments() const;
  /// The segments and, in `stats`, the statistics of the same instant (one lock),
  /// so block sums equal the statistics even while other threads allocate.
  std::vector<SegmentInfo> segments(DeviceStats& stats) const;
  /// Size of the block behind a pointer handed out (its rounded size).
  std::size_t block_size(const void* ptr) const;
  /// True when `ptr` is a block this allocator handed out and has not taken back.
  bool owns(const void* ptr) const noexcept;
  /// The largest cached free block (0: none), what the largest request served without a
  /// new segment could be; cheap (no walk over the blocks), so it can be read per event.
  std::size_t largest_free_block() const;

  /// Checks every invariant: blocks tile their segment, free neighbours are
  /// coalesced, pools hold exactly the free blocks, statistics equal sums
  /// recomputed from the blocks. Throws mem::Error naming the first violation.
  void validate() const;

  /// Observers are called under the lock for every event; see observer.hpp.
  void add_observer(AllocatorObserver* observer);
  void remove_observer(AllocatorObserver* observer) noexcept;
  /// Rings the allocator writes every event into itself, without an observer
  /// call (see event_ring.hpp; mem::History is the usual owner). Attaching one
  /// twice is a no-op; detach before destroying the ring.
  void attach_ring(EventRing* ring);
  void detach_ring(EventRing* ring) noexcept;
  void set_context_source(ContextSource source) noexcept;

  /// Reserves an empty cached segment of exactly `bytes` (a multiple of 512) in the
  /// given pool, as if a previous allocation had created it; for trace replay.
  /// Returns its address.
  std::uintptr_t reserve_segment(std::size_t bytes, StreamId stream, bool small_pool);

  /// A live block of a segment being restored: where it starts in the segment, its size
  /// (both multiples of 512) and the caller's size (0: the size).
  struct RestoredBlock {
    std::size_t offset = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
  };
  /// Reserves a segment of exactly `bytes` in the given pool and hands out `live` at their
  /// offsets (ascending, not overlapping, inside the segment); the gaps stay free. A
  /// recorded state rebuilt as it was, whatever these settings would have made of it:
  /// trace replay starts every setting from the recording's state. Returns the live
  /// blocks' pointers in order. Throws mem::Error for a bad layout or when the device has
  /// no room; nothing changes then.
  std::vector<void*> restore_segment(std::size_t bytes, StreamId stream, bool small_pool,
                                     const std::vector<RestoredBlock>& live);
  /// The same for a mapped range of an expandable segment (expandable_segments:True only):
  /// maps [base + offset, + bytes) of the stream's expandable segment in the pool (reserved
  /// first when it has none; `offset` and `bytes` whole pages, the range unmapped) and hands
  /// out `live` at their offsets in the range. Throws mem::Error as restore_segment does.
  std::vector<void*> restore_expandable(std::size_t offset, std::size_t bytes, StreamId stream, bool small_pool,
                                        const std::vector<RestoredBlock>& live);
  /// Where the stream's expandable segment in the pool begins, reserving it (addresses
  /// only, no memory, no event) when it has none. Throws mem::Error without
  /// expandable_segments:True or when no address space is left.
  std::uintptr_t expandable_segment_base(StreamId stream, bool small_pool);

  Device& device() const noexcept;
  std::shared_ptr<Device> device_ptr() const noexcept;
  const AllocatorConfig& config() const noexcept;

 private:
  std::unique_ptr<detail::AllocatorCore> core_;
};

/// The process-wide allocator for applications to link in: created on first use
/// from VRAMSCOPE_DEVICE (default "auto") and VRAMSCOPE_ALLOC_CONF.
CachingAllocator& process_allocator();

}  // namespace mem
