// allocator_core.hpp — the caching allocator's state and policy (internal).
//
// Data, as in PyTorch's DeviceCachingAllocator:
//  - a segment is one device allocation, tiled by Blocks linked prev/next (block.hpp);
//  - a free Block sits in exactly one BlockPool (small or large), in
//    (stream, size, address) order so the first that fits is best fit
//    (block_pool.hpp);
//  - an active Block (allocated, or freed but waiting for stream events) sits
//    in active_, keyed by address;
//  - an expandable segment (expandable_segments:True) is a reserved address
//    range in expandable_, tiled by mapped Blocks (free ones in the pool, as
//    above) and unmapped ones (in the pool's `unmapped` set);
//  - pool_stats_ and stats_ are updated at every transition and validate()
//    recomputes them.
// Everything is guarded by lock_.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "biased_lock.hpp"
#include "block_pool.hpp"
#include "expandable_segment.hpp"
#include "object_pool.hpp"
#include "pointer_map.hpp"
#include "pool_stats.hpp"
#include "vramscope/allocator/caching_allocator.hpp"

namespace mem::detail {

/// A private pool (PyTorch's PrivatePool): the large and small blocks of CUDA graph captures
/// (or a MemPool), in segments of their own.
struct PrivatePool {
  explicit PrivatePool(PoolId pool_id) : id(pool_id) { large.owner = small.owner = this; }
  PoolId id;
  BlockPool large{false};
  BlockPool small{true};
  int use_count = 1;          // captures and graphs that use it; at 0 its segments may go
  std::size_t reserved = 0;   // bytes of its segments (cudaMalloc'd or mapped)
};

class AllocatorCore {
 public:
  AllocatorCore(std::shared_ptr<Device> device, AllocatorConfig config);
  ~AllocatorCore();

  void* malloc(std::size_t size, StreamId stream);
  void free(void* ptr);
  void record_stream(void* ptr, StreamId stream);
  bool relabel(const void* ptr, std::uint32_t context) noexcept;
  void empty_cache();
  PoolId graph_pool_handle() noexcept;
  void begin_allocate_to_pool(PoolId pool, StreamId stream);
  void end_allocate_to_pool(PoolId pool);
  void release_pool(PoolId pool);
  /// The private pools' reserved bytes, or with `allocated` their live blocks' bytes.
  std::size_t private_pool_bytes(bool allocated) const;
  void set_memory_fraction(double fraction);
  void load_module(std::string_view name, std::size_t bytes);
  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  /// The segments; with `stats` also the statistics, taken under the same lock.
  std::vector<SegmentInfo> segments(DeviceStats* stats = nullptr) const;
  std::size_t block_size(const void* ptr) const;
  bool owns(const void* ptr) const noexcept;
  std::size_t largest_free_block() const;
  void validate() const;
  void add_observer(AllocatorObserver* observer);
  void remove_observer(AllocatorObserver* observer) noexcept;
  void attach_ring(EventRing* ring);
  void detach_ring(EventRing* ring) noexcept;
  void set_context_source(ContextSource source) noexcept;
  std::uintptr_t reserve_segment(std::size_t bytes, StreamId stream, bool small_pool);
  std::vector<void*> restore_segment(std::size_t bytes, StreamId stream, bool small_pool,
                                     const std::vector<CachingAllocator::RestoredBlock>& live);
  std::vector<void*> restore_expandable(std::size_t offset, std::size_t bytes, StreamId stream, bool small_pool,
                                        const std::vector<CachingAllocator::RestoredBlock>& live);
  std::uintptr_t expandable_segment_base(StreamId stream, bool small_pool);

  Device& device() const noexcept { return *device_; }
  const std::shared_ptr<Device>& device_ptr() const noexcept { return device_; }
  const AllocatorConfig& config() const noexcept { return config_; }

 private:
  struct AllocParams {
    std::size_t orig_size = 0;
    std::size_t size = 0;        // rounded
    std::size_t alloc_size = 0;  // segment size on a miss
    StreamId stream = 0;
    BlockPool* pool = nullptr;
    Block* block = nullptr;
    bool block_in_pool = false;  // found in the pool (still linked there) vs a new segment
    bool plain_segment = false;  // a cudaMalloc segment even with expandable segments (restores)
  };

  // Policy steps, named after their PyTorch counterparts.
  bool get_free_block(AllocParams& p);
  bool alloc_block(AllocParams& p, bool is_retry);
  bool release_available_cached_blocks(const AllocParams& p);
  /// A new cudaMalloc segment of exactly `bytes` in the pool, one free block in no pool yet
  /// (reserve_segment and restore_segment; expandable segments or not), or nullptr.
  Block* plain_segment_locked(std::size_t bytes, StreamId stream, bool small_pool);
  void release_cached_blocks();
  /// The pool a request of `size` bytes on `stream` takes its block from (PyTorch's get_pool):
  /// a capture's private pool when one is allocating that stream's blocks.
  BlockPool* get_pool(std::size_t size, StreamId stream) noexcept;
  std::size_t private_allocated_locked() const;
  /// Every pool, the default two first, then each private pool's large and small.
  std::vector<const BlockPool*> pools_locked() const;
  /// A private pool's segment bytes follow its segments (a no-op for the default pools).
  static void count_private(const BlockPool& pool, std::int64_t bytes) noexcept {
    if (pool.owner != nullptr) pool.owner->reserved = static_cast<std::size_t>(static_cast<std::int64_t>(pool.owner->reserved) + bytes);
  }
  void release_blocks(BlockPool& pool);
  void release_block(Block* block);
  void garbage_collect_cached_blocks();
  // Expandable segments (PyTorch's names).
  /// Maps enough of a segment of p.stream to hold p.size bytes in one free block and
  /// returns that block (in the pool), or nullptr when the device is out of memory.
  Block* try_allocate_expandable_block(const AllocParams& p);
  /// The first unmapped block of the stream (by address) that, with a free block before
  /// it and the free blocks after it, spans `size` bytes; a new segment's when none does.
  Block* find_expandable_block(StreamId stream, BlockPool& pool, std::size_t size);
  bool map_block(Block* to_map, std::size_t size);
  void unmap_block(Block* block);
  /// Merges free neighbour `src` into `dst` when both are mapped or both unmapped.
  std::size_t try_merge_blocks(Block* dst, Block* src, BlockPool& pool);
  void release_expandable_segment(Block* block);
  /// The statistics, device view and event of pages mapped (or unmapped) in `pool`.
  void count_pages(const BlockPool& pool, AddressRange range, StreamId stream, bool mapped);
  /// Hands out `live` (offsets from whole->ptr) in `whole`, a free block in no pool, and
  /// pools the gaps: the common half of restore_segment and restore_expandable.
  std::vector<void*> carve_restored(Block* whole, const std::vector<CachingAllocator::RestoredBlock>& live);
  ExpandableSegment& segment_of(const Block* b) const noexcept { return *expandable_[b->segment - 1u]; }
  /// Reserves a new expandable segment of `stream` in `pool`: its one unmapped block.
  Block* new_expandable_segment(StreamId stream, BlockPool& pool);
  Block* new_block(std::uintptr_t ptr, std::size_t size, StreamId stream, BlockPool* pool,
                   std::uint16_t segment, bool mapped);
  Block* alloc_found_block(AllocParams& p);
  /// The accounting of a block handed out (allocation, statistics, the Alloc event).
  void hand_out(Block* block, std::size_t requested, std::size_t pi);
  /// `pool` is the block's (passed: the block's own field is in its second line).
  bool should_split(const BlockPool& pool, const Block* block, std::size_t size) const noexcept;
  /// Returns a block to its pool; `report` emits FreeCompleted (deferred frees).
  /// `in_map`: the block is still in active_ (false when free() already removed it).
  void free_block(Block* block, bool report = true, bool in_map = true);
  /// free_block's part after the accounting and the address map: coalesces the block
  /// with its free neighbours and pools the result. Inline in free() and free_block().
  void pool_freed_block(Block* block);
  /// The accounting of a free: the block stops being allocated (FreeRequested).
  void release_allocation(Block* block, bool completed) noexcept;
  /// free() of a block that record_stream marked: defers its reuse behind events.
  void free_used_on_streams(Block** found);
  /// Creates and records one event per stream the block was used on; on a device
  /// error destroys those already made and rethrows, so a failed free changes nothing.
  std::vector<std::pair<StreamId, EventId>> record_use_events(const Block& block);
  void process_events();
  void synchronize_and_free_events();
  [[noreturn]] void throw_oom(const AllocParams& p);
  /// Counts an out-of-memory failure, records PyTorch's oom entry when instrumented
  /// (device_free as its address, stamped with who asked) and returns the figures the
  /// error carries: what both throwing paths (a block, a library's kernels) share.
  OutOfMemoryError::Figures note_oom(const DeviceMemInfo& mem, std::size_t size, std::size_t requested,
                                     StreamId stream, BlockPool* pool);
  /// The figures at this moment (under the lock); counts and records nothing.
  OutOfMemoryError::Figures current_figures(const DeviceMemInfo& mem, std::size_t requested) const;
  /// A request over 1 PiB: refused with the state it met and who asked; changes nothing.
  [[noreturn]] void throw_too_large(std::size_t requested);

  /// The pool's index in a PoolStat.
  static std::size_t pool_index(const BlockPool& pool) noexcept {
    return pool.is_small ? kSmallPoolIndex : kLargePoolIndex;
  }
  /// DeviceStats with the per-pool arrays filled in (under the lock).
  DeviceStats stats_locked() const;
  std::size_t device_rounded(std::size_t bytes) const noexcept;
  void update_device_view() noexcept;

  /// Records one event in every ring (inline stores) and hands it to every
  /// observer (a virtual call each). Callers test instrumented_ first.
  /// Inline (defined in allocator_core.cpp, its only user) so that the ring's
  /// stores take the fields from registers.
  inline void emit(TraceAction action, const Block* b, std::size_t size, std::size_t requested,
            bool completed = false) noexcept;
  void notify_observers(const TraceEvent& e) noexcept;
  /// instrumented_ from the two lists, after either changes (under the lock).
  void update_instrumented() noexcept { instrumented_ = !rings_.empty() || !observers_.empty(); }
  void emit_segment(TraceAction action, std::uintptr_t ptr, std::size_t size, StreamId stream,
                    bool small, std::uint32_t context) noexcept;

  std::vector<const Block*> all_blocks_locked() const;
  /// validate()'s checks of the expandable segments' tiling and unmapped blocks.
  void validate_expandable_locked() const;
  /// Why `ptr` is not a live block of this allocator, for error messages (slow path):
  /// already freed, interior to a block, or outside every segment.
  std::string explain_unknown_pointer_locked(std::uintptr_t ptr) const;

  std::shared_ptr<Device> device_;
  AllocatorConfig config_;
  std::size_t granularity_;
  std::size_t context_bytes_;
  bool has_divisions_ = false;  // any roundup_power2_divisions > 1 configured

  mutable BiasedLock lock_;  // atomic-free for the thread that uses it first
  BlockPool large_blocks_{false};
  BlockPool small_blocks_{true};
  PointerMap<Block*> active_;  // allocated or pending-free blocks by address
  RecyclingPool<Block> block_storage_;
  std::map<StreamId, std::deque<std::pair<EventId, Block*>>> events_;  // per-stream, in order
  PoolStats pool_stats_;  // the per-pool arrays, updated on every transition
  DeviceStats stats_;     // everything else; its arrays are filled only when read
  std::size_t total_reserved_ = 0;          // sum of segment sizes (total_allocated_memory)
  std::size_t total_reserved_rounded_ = 0;  // the same at driver granularity
  bool set_fraction_ = false;
  std::size_t allowed_memory_maximum_ = 0;

  std::map<PoolId, std::unique_ptr<PrivatePool>> private_pools_;
  std::vector<std::pair<PoolId, StreamId>> captures_;  // pools being allocated to, and by which stream
  PoolId next_pool_id_ = 1;

  /// Expandable segments by index (Block::segment - 1); a released one leaves a null slot.
  std::vector<std::unique_ptr<ExpandableSegment>> expandable_;

  std::vector<EventRing*> rings_;
  std::vector<AllocatorObserver*> observers_;
  bool instrumented_ = false;  // any ring or observer: the one branch uninstrumented runs pay
  ContextSource context_source_ = nullptr;
  std::uint64_t sequence_ = 0;
};

}  // namespace mem::detail
