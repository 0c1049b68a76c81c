// allocator_core.cpp — the caching policy: malloc, free, split, coalesce,
// stream events, free-cache-and-retry and the out-of-memory error.
// Follows c10/cuda/CUDACachingAllocator.cpp step by step (same names), so
// statistics and segment layouts match what PyTorch users see.
#include <algorithm>
#include <cassert>
#include <limits>
#include <mutex>
#include <string>

#include "allocator_core.hpp"

#include <type_traits>
#include "vramscope/allocator/units.hpp"

namespace mem::detail {

AllocatorCore::AllocatorCore(std::shared_ptr<Device> device, AllocatorConfig config)
    : device_(std::move(device)), config_(config) {
  if (!device_) throw Error("CachingAllocator needs a device (got a null pointer)");
  const DeviceInfo& info = device_->info();
  granularity_ = info.granularity == 0 ? 1 : info.granularity;
  context_bytes_ = info.context_bytes + device_->module_bytes();  // libraries loaded before this allocator
  stats_.max_split_size = config_.max_split_size == std::numeric_limits<std::size_t>::max()
                              ? std::numeric_limits<std::int64_t>::max()
                              : static_cast<std::int64_t>(config_.max_split_size);
  stats_.device_total_bytes = static_cast<std::int64_t>(info.total_bytes);
  has_divisions_ = std::any_of(config_.roundup_power2_divisions.begin(),
                               config_.roundup_power2_divisions.end(),
                               [](std::size_t d) { return d > 1; });
  stats_.context_bytes = static_cast<std::int64_t>(context_bytes_);
  large_blocks_.tracks_age = small_blocks_.tracks_age = config_.garbage_collection_threshold > 0.0;
  // nvidia-smi shows the context before any allocation.
  stats_.device_used_bytes.current = stats_.device_used_bytes.peak =
      static_cast<std::int64_t>(context_bytes_);
  if (config_.expandable_segments && !device_->supports_virtual_memory()) {
    throw Error("expandable_segments:True needs virtual memory management, which " + info.name +
                " does not have (the driver's cuMemCreate/cuMemMap were not found or the GPU does not "
                "support them); leave expandable_segments out");
  }
}

AllocatorCore::~AllocatorCore() {
  // Return every segment: wait for pending events, then free each segment head.
  std::lock_guard guard(lock_);
  for (auto& [stream, queue] : events_) {
    for (auto& [event, block] : queue) {
      device_->synchronize_event(event);
      device_->destroy_event(event);
    }
  }
  events_.clear();
  std::vector<const Block*> blocks = all_blocks_locked();  // one walk serves both loops
  for (const Block* b : blocks) {
    if (b->prev == nullptr && !b->expandable()) {
      std::size_t total = 0;
      for (const Block* c = b; c != nullptr; c = c->next) total += c->size;
      device_->free_segment(reinterpret_cast<void*>(b->ptr), total);
    }
  }
  expandable_.clear();  // unmaps their pages and releases their addresses
  for (const BlockPool* pool : pools_locked()) {
    blocks.insert(blocks.end(), pool->unmapped.begin(), pool->unmapped.end());
  }
  // Released, so block_storage_ destroys them (a block's stream_uses may hold memory).
  for (const Block* b : blocks) block_storage_.release(const_cast<Block*>(b));
}

// ---------------------------------------------------------------------------
// malloc

// Inlined into malloc, its one caller: out of line it cost a tenth of the
// fast path in calls and spills.
[[gnu::always_inline]] inline bool AllocatorCore::get_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (set_fraction_ && config_.garbage_collection_threshold > 0.0) [[unlikely]] {
    ++pool.get_free_blocks_call_count;  // block ages only matter to the collector
  }
  Block* fit = pool.best_fit(p.stream, p.size);
  if (fit == nullptr) return false;
  // No expandable segment made, no expandable block: the test then leaves the fit's
  // second cache line unread.
  if (!expandable_.empty() && fit->expandable()) [[unlikely]] {
    if (config_.expandable_segments) {
      // PyTorch: "for the purposes of 'best fit' we consider its size to be the size it can
      // expand to": a free block before unmapped space counts that space too, so a block
      // that can grow is passed over for the next larger one that cannot, while that one's
      // expandable size is smaller.
      const auto expandable_size = [](const Block* b) {
        return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
      };
      for (Block* next = pool.after(fit);
           fit->expandable() && next != nullptr && expandable_size(next) < expandable_size(fit);
           next = pool.after(next)) {
        fit = next;
      }
    } else {
      // Expandable segments were turned off: only cudaMalloc segments serve.
      do {
        fit = pool.after(fit);
      } while (fit != nullptr && fit->expandable());
      if (fit == nullptr) return false;
    }
  }
  const std::size_t max_split = config_.max_split_size;
  // Never hand an oversize block to a small request (it could not be split).
  if (p.size < max_split && fit->size >= max_split) return false;
  // An oversize request takes an oversize block only if little is wasted.
  if (p.size >= max_split && fit->size >= p.size + config_.max_non_split_rounding_size) {
    return false;
  }
  p.block = fit;
  p.block_in_pool = true;  // alloc_found_block unlinks or re-keys it
  return true;
}

// Inlined into malloc, its one caller: no capture under way costs one test.
[[gnu::always_inline]] inline BlockPool* AllocatorCore::get_pool(std::size_t size, StreamId stream) noexcept {
  if (!captures_.empty()) [[unlikely]] {
    for (const auto& [id, capture_stream] : captures_) {
      if (capture_stream != stream) continue;
      PrivatePool& pool = *private_pools_.at(id);
      return size <= kSmallSize ? &pool.small : &pool.large;
    }
  }
  return size <= kSmallSize ? &small_blocks_ : &large_blocks_;
}

// Cache-line aligned, as free() is: the same code runs from the executable's copy and from
// libvramscope.so's, and its timing followed where each copy happened to start (the C API
// pair 8.8 -> 6.6 ns over the C++ pair, issue 35).
[[gnu::aligned(64)]] void* AllocatorCore::malloc(std::size_t orig_size, StreamId stream) {
  if (orig_size == 0) {
    throw Error("allocate(0): a zero-byte request is not allowed (nothing was allocated)");
  }
  if (orig_size > kMaxRequestSize) [[unlikely]] throw_too_large(orig_size);
  std::lock_guard guard(lock_);
  if (!events_.empty()) [[unlikely]] process_events();

  AllocParams p;
  p.orig_size = orig_size;
  // Plain 512 B rounding inline; the power-of-two divisions only when configured.
  p.size = has_divisions_ ? round_size(orig_size, config_)
           : orig_size < kMinBlockSize ? kMinBlockSize
                                       : (orig_size + kMinBlockSize - 1) & ~(kMinBlockSize - 1);
  p.stream = stream;
  p.pool = get_pool(p.size, stream);

  bool found = get_free_block(p);
  if (!found) {
    // Checked on the miss path only: a stream's first request always misses (its pool
    // holds nothing yet), so a never-created stream is refused before it owns a block.
    if (!device_->has_stream(stream)) [[unlikely]] {
      throw Error("allocate(" + std::to_string(orig_size) + " B): stream " + std::to_string(stream) +
                  " is not a stream of this device (destroyed, or never created); nothing was allocated");
    }
    p.alloc_size = segment_size_for(p.size);
    if (set_fraction_ && config_.garbage_collection_threshold > 0.0) [[unlikely]] {
      garbage_collect_cached_blocks();
    }
    found = alloc_block(p, false) ||
            (release_available_cached_blocks(p) && alloc_block(p, false)) ||
            (release_cached_blocks(), alloc_block(p, true));
  }
  if (!found) throw_oom(p);
  return reinterpret_cast<void*>(alloc_found_block(p)->ptr);
}

bool AllocatorCore::alloc_block(AllocParams& p, bool is_retry) {
  const std::size_t size = p.alloc_size;
  if (is_retry) ++stats_.num_alloc_retries;
  if (set_fraction_ && total_reserved_ + size > allowed_memory_maximum_) return false;
  if (config_.expandable_segments && !p.plain_segment) {
    // Grows an expandable segment by the rounded request (not the segment size).
    p.block = try_allocate_expandable_block(p);
    p.block_in_pool = true;
    return p.block != nullptr;
  }
  void* ptr = device_->allocate_segment(size);
  if (ptr == nullptr) return false;
  ++stats_.num_device_alloc;
  total_reserved_ += size;
  total_reserved_rounded_ += device_rounded(size);

  Block* block = new_block(reinterpret_cast<std::uintptr_t>(ptr), size, p.stream, p.pool, 0, true);
  p.block = block;
  p.block_in_pool = false;

  const std::size_t pi = pool_index(*p.pool);
  pool_stats_.segment.increase(pi, 1);
  pool_stats_.reserved_bytes.increase(pi, static_cast<std::int64_t>(size));
  count_private(*p.pool, static_cast<std::int64_t>(size));
  if (size >= config_.max_split_size) stats_.oversize_segments.increase(1);
  update_device_view();
  if (instrumented_) [[unlikely]] {
    // Stamp the segment with the caller's context: which module caused the cudaMalloc.
    emit_segment(TraceAction::SegmentAlloc, block->ptr, size, p.stream, p.pool->is_small,
                 context_source_ ? context_source_() : 0);
  }
  return true;
}

bool AllocatorCore::release_available_cached_blocks(const AllocParams& p) {
  const std::size_t max_split = config_.max_split_size;
  if (max_split == std::numeric_limits<std::size_t>::max()) return false;
  BlockPool& pool = *p.pool;
  const std::size_t wanted = p.size < max_split ? max_split : p.size;
  // Only a whole cached segment can be given back. PyTorch never splits an oversize block,
  // so it need not ask; a restored recording (replay) can hold an oversize free gap between
  // live blocks, and an expandable segment gives back pages, not segments.
  const auto releasable = [](const Block* b) { return !b->expandable() && !b->is_split(); };
  Block* fit = pool.best_fit(p.stream, wanted);
  if (fit != nullptr && releasable(fit)) {
    release_block(fit);
    return true;
  }
  // No single oversize block is enough: free oversize blocks, largest first (below the
  // block found, which cannot be released).
  std::size_t released = 0;
  Block* block = fit != nullptr ? pool.before(fit) : pool.largest(p.stream);
  while (released < wanted && block != nullptr && block->size >= max_split) {
    Block* smaller = pool.before(block);
    if (releasable(block)) {
      released += block->size;
      release_block(block);
    }
    block = smaller;
  }
  return released >= wanted;
}

void AllocatorCore::release_cached_blocks() {
  synchronize_and_free_events();
  release_blocks(large_blocks_);
  release_blocks(small_blocks_);
  // Private pools nobody uses give back their free segments; a pool goes with its last one
  // (PyTorch's graph_pools_freeable). One in use keeps its cache, which its graphs replay into.
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    PrivatePool& pool = *it->second;
    if (pool.use_count > 0) {
      ++it;
      continue;
    }
    release_blocks(pool.large);
    release_blocks(pool.small);
    // An expandable segment that never mapped a page (its first map failed) holds addresses only.
    for (BlockPool* half : {&pool.large, &pool.small}) {
      std::vector<Block*> whole;
      for (Block* block : half->unmapped) {
        if (!block->is_split()) whole.push_back(block);
      }
      for (Block* block : whole) release_expandable_segment(block);
    }
    const bool empty = pool.reserved == 0 && pool.large.unmapped.empty() && pool.small.unmapped.empty();
    it = empty ? private_pools_.erase(it) : std::next(it);
  }
}

std::vector<const BlockPool*> AllocatorCore::pools_locked() const {
  std::vector<const BlockPool*> out{&large_blocks_, &small_blocks_};
  for (const auto& [id, pool] : private_pools_) {
    out.push_back(&pool->large);
    out.push_back(&pool->small);
  }
  return out;
}

PoolId AllocatorCore::graph_pool_handle() noexcept {
  std::lock_guard guard(lock_);
  return next_pool_id_++;
}

void AllocatorCore::begin_allocate_to_pool(PoolId id, StreamId stream) {
  std::lock_guard guard(lock_);
  const std::string which = "begin_allocate_to_pool(" + std::to_string(id) + ")";
  if (id == 0 || id >= next_pool_id_) {
    throw Error(which + ": no graph_pool_handle() gave this id (0 is the default pools); nothing changed");
  }
  for (const auto& [pool, capture_stream] : captures_) {
    if (pool == id) throw Error(which + ": the pool is already being allocated to (end_allocate_to_pool first); nothing changed");
    if (capture_stream == stream) {
      throw Error(which + ": stream " + std::to_string(stream) + " already allocates to pool " + std::to_string(pool) +
                  "; nothing changed");
    }
  }
  if (!device_->has_stream(stream)) {
    throw Error(which + ": stream " + std::to_string(stream) + " is not a stream of this device; nothing changed");
  }
  auto found = private_pools_.find(id);
  if (found != private_pools_.end() && found->second->use_count == 0) {
    throw Error(which + ": the pool was released (take a new graph_pool_handle()); nothing changed");
  }
  captures_.reserve(captures_.size() + 1);  // the push below cannot throw after the pool changed
  if (found == private_pools_.end()) {
    auto pool = std::make_unique<PrivatePool>(id);
    pool->large.tracks_age = pool->small.tracks_age = large_blocks_.tracks_age;
    private_pools_.emplace(id, std::move(pool));
  } else {
    ++found->second->use_count;
  }
  captures_.emplace_back(id, stream);
}

void AllocatorCore::end_allocate_to_pool(PoolId id) {
  std::lock_guard guard(lock_);
  const auto it = std::find_if(captures_.begin(), captures_.end(), [&](const auto& c) { return c.first == id; });
  if (it == captures_.end()) {
    throw Error("end_allocate_to_pool(" + std::to_string(id) + "): the pool is not being allocated to; nothing changed");
  }
  captures_.erase(it);
}

void AllocatorCore::release_pool(PoolId id) {
  std::lock_guard guard(lock_);
  const auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count == 0) {
    throw Error("release_pool(" + std::to_string(id) + "): " +
                (it == private_pools_.end() ? "no such private pool" : "the pool has no user left") + "; nothing changed");
  }
  --it->second->use_count;
}

std::size_t AllocatorCore::private_pool_bytes(bool allocated) const {
  std::lock_guard guard(lock_);
  if (allocated) return private_allocated_locked();
  std::size_t total = 0;
  for (const auto& [id, pool] : private_pools_) total += pool->reserved;
  return total;
}

std::size_t AllocatorCore::private_allocated_locked() const {
  std::size_t total = 0;
  active_.for_each([&](std::uintptr_t, Block* b) {
    if (b->allocated && b->pool->owner != nullptr) total += b->size;
  });
  return total;
}

void AllocatorCore::release_blocks(BlockPool& pool) {
  // Free blocks of expandable segments give back their whole pages, split or not; they
  // are gathered first, since unmapping changes the pool being walked.
  std::vector<Block*> to_unmap;
  pool.for_each([&](Block* block) {
    if (block->expandable()) {
      to_unmap.push_back(block);
    } else if (!block->is_split()) {
      release_block(block);
    }
  });
  for (Block* block : to_unmap) {
    unmap_block(block);
    if (!block->mapped && !block->is_split()) release_expandable_segment(block);
  }
}

void AllocatorCore::release_block(Block* block) {
  assert(!block->expandable() && "an expandable segment gives back pages, not the segment");
  assert(!block->is_split() && "only a whole segment goes back to the device");
  BlockPool& pool = *block->pool;
  const std::size_t size = block->size;
  device_->free_segment(reinterpret_cast<void*>(block->ptr), size);
  ++stats_.num_device_free;
  total_reserved_ -= size;
  total_reserved_rounded_ -= device_rounded(size);
  const std::size_t pi = pool_index(pool);
  pool_stats_.segment.decrease(pi, 1);
  pool_stats_.reserved_bytes.decrease(pi, static_cast<std::int64_t>(size));
  count_private(pool, -static_cast<std::int64_t>(size));
  if (size >= config_.max_split_size) stats_.oversize_segments.decrease(1);
  update_device_view();
  if (instrumented_) [[unlikely]] {
    emit_segment(TraceAction::SegmentFree, block->ptr, size, block->stream, pool.is_small,
                 context_source_ ? context_source_() : 0);
  }
  pool.erase(block, block->stream);
  block_storage_.release(block);
}

void AllocatorCore::garbage_collect_cached_blocks() {
  // Free cached large segments older than the average age until the reserved
  // bytes fall under threshold * allowed (PyTorch's age-based collector).
  const auto threshold = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                                  static_cast<double>(allowed_memory_maximum_));
  if (total_reserved_ <= threshold) return;
  const std::size_t target = total_reserved_ - threshold;
  std::size_t reclaimed = 0;
  double total_age = 0;
  std::size_t freeable = 0;
  auto age = [&](const Block* b) {
    return static_cast<double>(large_blocks_.get_free_blocks_call_count - b->gc_count_base);
  };
  large_blocks_.for_each([&](const Block* b) {
    if (!b->is_split() && !b->expandable()) {
      total_age += age(b);
      ++freeable;
    }
  });
  if (freeable == 0) return;
  bool freed = true;
  while (reclaimed < target && freed && freeable > 0) {
    const double age_threshold = total_age / static_cast<double>(freeable);
    freed = false;
    large_blocks_.for_each([&](Block* b) {
      if (!b->is_split() && !b->expandable() && age(b) >= age_threshold) {
        freed = true;
        reclaimed += b->size;
        total_age -= age(b);
        --freeable;
        release_block(b);
      }
    });
  }
}

bool AllocatorCore::should_split(const BlockPool& pool, const Block* block,
                                 std::size_t size) const noexcept {
  const std::size_t remaining = block->size - size;
  if (pool.is_small || config_.expandable_segments) return remaining >= kMinBlockSize;
  return size < config_.max_split_size && remaining > kSmallSize;
}

[[gnu::always_inline]] inline void AllocatorCore::hand_out(Block* block, std::size_t requested, std::size_t pi) {
  block->allocated = true;
  block->requested_size = requested;
  block->context = context_source_ ? context_source_() : 0;
  active_.insert(block->ptr, block);

  const auto bytes = static_cast<std::int64_t>(block->size);
  pool_stats_.allocation.increase(pi, 1);
  pool_stats_.allocated_bytes.increase(pi, bytes);
  if (pool_stats_.active_tracked) [[unlikely]] {
    pool_stats_.active.increase(pi, 1);
    pool_stats_.active_bytes.increase(pi, bytes);
  }
  pool_stats_.requested_bytes.increase(pi, static_cast<std::int64_t>(requested));
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.increase(1);
  if (instrumented_) [[unlikely]] {
    emit(TraceAction::Alloc, block, block->size, requested);
  }
}

// Inlined into malloc, its one caller, as get_free_block is.
[[gnu::always_inline]] inline Block* AllocatorCore::alloc_found_block(AllocParams& p) {
  Block* block = p.block;
  BlockPool& pool = *p.pool;
  const std::size_t pi = pool_index(pool);
  const bool already_split = block->is_split();
  if (should_split(pool, block, p.size)) {
    // The front becomes the allocation; the rest stays free in the pool.
    Block* remaining = block;
    block = block_storage_.acquire();  // recycled: fields set here and below
    block->ptr = remaining->ptr;
    block->size = p.size;
    block->stream = p.stream;
    block->pool = &pool;
    block->segment = expandable_.empty() ? 0 : remaining->segment;  // as above: one line of `remaining`
    block->mapped = true;
    block->prev = remaining->prev;
    if (block->prev) block->prev->next = block;
    block->next = remaining;
    remaining->prev = block;
    if (p.block_in_pool) {
      pool.rekey(remaining, p.stream, remaining->ptr + p.size, remaining->size - p.size);
    } else {
      remaining->ptr += p.size;
      remaining->size -= p.size;
      pool.insert(remaining);
    }
    // inactive_split leaves expandable segments out: their free pages can always be released.
    if (!block->expandable()) {
      // A split block gives its front away (its remainder stays counted); a whole
      // segment's block leaves a split remainder behind.
      pool_stats_.inactive_split_bytes.add(pi, already_split ? -static_cast<std::int64_t>(block->size)
                                                             : static_cast<std::int64_t>(remaining->size));
      pool_stats_.inactive_split.add(pi, already_split ? 0 : 1);
    }
  } else {
    if (p.block_in_pool) pool.erase(block, p.stream);
    if (already_split && !block->expandable()) {
      pool_stats_.inactive_split_bytes.decrease(pi, static_cast<std::int64_t>(block->size));
      pool_stats_.inactive_split.decrease(pi, 1);
    }
  }

  hand_out(block, p.orig_size, pi);
  return block;
}

OutOfMemoryError::Figures AllocatorCore::note_oom(const DeviceMemInfo& mem, std::size_t size,
                                                  std::size_t requested, StreamId stream, BlockPool* pool) {
  ++stats_.num_ooms;
  if (instrumented_) {
    Block probe;
    probe.ptr = mem.free_bytes;  // PyTorch records device_free as the oom entry's address
    probe.stream = stream;
    probe.pool = pool;
    probe.context = context_source_ ? context_source_() : 0;  // who asked
    emit(TraceAction::Oom, &probe, size, requested);
  }
  return current_figures(mem, requested);
}

OutOfMemoryError::Figures AllocatorCore::current_figures(const DeviceMemInfo& mem, std::size_t requested) const {
  OutOfMemoryError::Figures f;
  f.requested = requested;
  f.device_total = mem.total_bytes;
  f.device_free = mem.free_bytes;
  f.process_used = static_cast<std::size_t>(stats_.device_used_bytes.current);
  f.allocated = static_cast<std::size_t>(pool_stats_.allocated_bytes.current());
  f.reserved = static_cast<std::size_t>(pool_stats_.reserved_bytes.current());
  f.allowed = set_fraction_ ? allowed_memory_maximum_ : 0;
  return f;
}

void AllocatorCore::throw_too_large(std::size_t requested) {
  const DeviceMemInfo mem = device_->mem_get_info();
  std::lock_guard guard(lock_);
  throw RequestTooLargeError("allocate(" + std::to_string(requested) + " B): request larger than 1 PiB, "
                             "probably an overflowed size computation (nothing was allocated)",
                             current_figures(mem, requested), context_source_ ? context_source_() : 0);
}

[[noreturn]] void AllocatorCore::throw_oom(const AllocParams& p) {
  const DeviceMemInfo mem = device_->mem_get_info();
  const OutOfMemoryError::Figures f = note_oom(mem, p.size, p.orig_size, p.stream, p.pool);
  const std::size_t allocated = f.allocated, reserved = f.reserved, used = f.process_used;
  const DeviceInfo& info = device_->info();
  std::string msg = "CUDA out of memory. Tried to allocate " + format_bytes(p.size) + ". ";
  msg += "GPU " + info.name + " has a total capacity of " + format_bytes(mem.total_bytes) +
         " of which " + format_bytes(mem.free_bytes) + " is free. ";
  msg += "This process has " + format_bytes(used) + " memory in use (nvidia-smi view";
  if (context_bytes_ > 0) {
    msg += ", including " + format_bytes(context_bytes_) +
           (context_bytes_ > info.context_bytes ? " CUDA context and libraries' kernels" : " CUDA context");
  }
  msg += "). ";
  if (set_fraction_) {
    msg += "The memory fraction allows " + format_bytes(allowed_memory_maximum_) + ". ";
  }
  // PyTorch counts the free blocks of private pools as allocated there (no other allocation can
  // take them): CUDACachingAllocator.cpp, malloc's out-of-memory message, allocated_in_private_pools.
  std::size_t in_private = 0;
  for (const auto& [id, pool] : private_pools_) {
    for (const BlockPool* half : {&pool->large, &pool->small}) half->for_each([&](const Block* b) { in_private += b->size; });
  }
  msg += "Of the allocated memory " + format_bytes(allocated + in_private) + " is allocated by vramscope, " +
         (in_private > 0 ? "with " + format_bytes(in_private) + " allocated in private pools (e.g., CUDA Graphs), " : "") +
         "and " + format_bytes(reserved - allocated - in_private) +
         " is reserved by vramscope but unallocated. ";
  // PyTorch's message suggests expandable_segments:True; with them on, max_split_size_mb
  // still keeps large blocks whole.
  msg += config_.expandable_segments
             ? "If reserved but unallocated memory is large try adding the setting max_split_size_mb:128 "
             : "If reserved but unallocated memory is large try the setting expandable_segments:True "
               "(or max_split_size_mb:128) ";
  msg += "(--alloc-conf in the vramscope command; VRAMSCOPE_ALLOC_CONF or the allocator's "
         "config in a program) to avoid fragmentation; otherwise reduce the batch size, "
         "checkpoint activations, or use a smaller dtype.";
  throw OutOfMemoryError(std::move(msg), f);
}

// ---------------------------------------------------------------------------
// expandable segments (PyTorch's try_allocate_expandable_block and friends)

namespace {
/// Links `b` into its segment's list right after `at` (PyTorch's Block::splice).
void splice_after(Block* at, Block* b) noexcept {
  b->prev = at;
  b->next = at->next;
  if (b->next != nullptr) b->next->prev = b;
  at->next = b;
}
/// Links `b` into its segment's list right before `at`.
void splice_before(Block* at, Block* b) noexcept {
  b->next = at;
  b->prev = at->prev;
  if (b->prev != nullptr) b->prev->next = b;
  at->prev = b;
}
/// An expandable segment's page in `pool`: the pool's segment size, 2 MiB small, 20 MiB large.
std::size_t page_size(const BlockPool& pool) noexcept { return pool.is_small ? kSmallBuffer : kLargeBuffer; }
}  // namespace

Block* AllocatorCore::new_block(std::uintptr_t ptr, std::size_t size, StreamId stream, BlockPool* pool,
                                std::uint16_t segment, bool mapped) {
  Block* b = block_storage_.acquire();  // recycled: every field set
  b->ptr = ptr;
  b->size = size;
  b->requested_size = 0;
  b->stream = stream;
  b->pool = pool;
  b->prev = nullptr;
  b->next = nullptr;
  b->allocated = false;
  b->event_count = 0;
  b->context = 0;
  b->segment = segment;
  b->mapped = mapped;
  return b;
}

Block* AllocatorCore::new_expandable_segment(StreamId stream, BlockPool& pool) {
  std::size_t slot = 0;
  while (slot < expandable_.size() && expandable_[slot] != nullptr) ++slot;
  if (slot >= 0xFFFF) return nullptr;  // Block::segment holds 65535 segments: a miss, as out of memory
  auto segment = std::make_unique<ExpandableSegment>(*device_, stream, page_size(pool));
  Block* whole = new_block(segment->base(), segment->size(), stream, &pool,
                           static_cast<std::uint16_t>(slot + 1), /*mapped=*/false);
  if (slot == expandable_.size()) expandable_.emplace_back();
  expandable_[slot] = std::move(segment);
  pool.unmapped.insert(whole);
  return whole;
}

Block* AllocatorCore::find_expandable_block(StreamId stream, BlockPool& pool, std::size_t size) {
  const auto allocatable = [](const Block* b) {
    return b != nullptr && !b->allocated && b->event_count == 0;
  };
  const auto has_room = [&](const Block* b) {
    std::size_t bytes = 0;
    for (; bytes < size && allocatable(b); b = b->next) bytes += b->size;
    return bytes >= size;
  };
  Block key;
  key.stream = stream;
  key.ptr = 0;
  for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    // The lowest unmapped space that fits, counting a free block just before it.
    Block* c = *it;
    if (allocatable(c->prev)) c = c->prev;
    if (has_room(c)) return c;
  }
  // A request larger than a whole segment (9/8 of the device) could never be mapped: no new
  // segment for it (PyTorch would reserve one per attempt and keep it).
  if (ExpandableSegment::size_for(*device_, page_size(pool)) < size) return nullptr;
  return new_expandable_segment(stream, pool);
}

Block* AllocatorCore::try_allocate_expandable_block(const AllocParams& p) {
  Block* candidate = nullptr;
  try {
    candidate = find_expandable_block(p.stream, *p.pool, p.size);
  } catch (const Error&) {
    return nullptr;  // no address space for a new segment: out of memory
  }
  if (candidate == nullptr) return nullptr;
  // Candidate: unmapped (-> *), or free -> unmapped -> *.
  if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, p.size))) return nullptr;
  while (candidate->size < p.size) {
    // Free -> unmapped: map what is missing, which merges the two.
    Block* next = candidate->next;
    if (!map_block(next, std::min(p.size - candidate->size, next->size))) return nullptr;
    candidate = next;
  }
  return candidate;  // mapped, free and in the pool
}

std::size_t AllocatorCore::try_merge_blocks(Block* dst, Block* src, BlockPool& pool) {
  if (src == nullptr || src->allocated || src->event_count > 0 || dst->mapped != src->mapped) return 0;
  if (dst->prev == src) {  // [src dst]
    dst->ptr = src->ptr;
    dst->prev = src->prev;
    if (dst->prev != nullptr) dst->prev->next = dst;
  } else {  // [dst src]
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  const std::size_t subsumed = src->size;
  dst->size += subsumed;
  if (src->mapped) {
    pool.erase(src, src->stream);
  } else {
    pool.unmapped.erase(src);
  }
  block_storage_.release(src);
  return subsumed;
}

bool AllocatorCore::map_block(Block* to_map, std::size_t size) {
  assert(!to_map->mapped && size <= to_map->size);
  const AddressRange mapped = segment_of(to_map).map(to_map->ptr, size);
  if (mapped.size == 0) return false;  // the device is out of memory
  BlockPool& pool = *to_map->pool;
  pool.unmapped.erase(to_map);
  to_map->mapped = true;
  if (mapped.size < to_map->size) {
    // to_map -> remaining (still unmapped) -> to_map->next
    Block* remaining = new_block(to_map->ptr + mapped.size, to_map->size - mapped.size, to_map->stream, &pool,
                                 to_map->segment, /*mapped=*/false);
    splice_after(to_map, remaining);
    pool.unmapped.insert(remaining);
    to_map->size = mapped.size;
  }
  try_merge_blocks(to_map, to_map->prev, pool);
  try_merge_blocks(to_map, to_map->next, pool);
  pool.insert(to_map);

  count_pages(pool, mapped, to_map->stream, true);
  return true;
}

void AllocatorCore::count_pages(const BlockPool& pool, AddressRange range, StreamId stream, bool mapped) {
  // Reserved memory follows the pages; the segment count does not (PyTorch's map_block and
  // unmap_block), and each map or unmap counts as one device call.
  const auto bytes = static_cast<std::int64_t>(range.size);
  if (mapped) {
    total_reserved_ += range.size;
    total_reserved_rounded_ += device_rounded(range.size);
    pool_stats_.reserved_bytes.increase(pool_index(pool), bytes);
    count_private(pool, bytes);
    ++stats_.num_device_alloc;
  } else {
    total_reserved_ -= range.size;
    total_reserved_rounded_ -= device_rounded(range.size);
    pool_stats_.reserved_bytes.decrease(pool_index(pool), bytes);
    count_private(pool, -bytes);
    ++stats_.num_device_free;
  }
  update_device_view();
  if (instrumented_) [[unlikely]] {
    emit_segment(mapped ? TraceAction::SegmentMap : TraceAction::SegmentUnmap, range.ptr, range.size, stream,
                 pool.is_small, context_source_ ? context_source_() : 0);
  }
}

void AllocatorCore::unmap_block(Block* block) {
  const AddressRange unmapped = segment_of(block).unmap(block->ptr, block->size);
  if (unmapped.size == 0) return;  // no whole page inside
  BlockPool& pool = *block->pool;
  pool.erase(block, block->stream);
  // The parts of pages at either end that stay mapped become free blocks of their own.
  const std::size_t before = unmapped.ptr - block->ptr;
  if (before > 0) {  // prev -> before_free -> block
    Block* before_free = new_block(block->ptr, before, block->stream, &pool, block->segment, true);
    splice_before(block, before_free);
    pool.insert(before_free);
  }
  const std::size_t after = block->size - before - unmapped.size;
  if (after > 0) {  // block -> after_free -> next
    Block* after_free = new_block(unmapped.ptr + unmapped.size, after, block->stream, &pool, block->segment, true);
    splice_after(block, after_free);
    pool.insert(after_free);
  }
  block->ptr = unmapped.ptr;
  block->size = unmapped.size;
  block->mapped = false;
  try_merge_blocks(block, block->prev, pool);
  try_merge_blocks(block, block->next, pool);
  pool.unmapped.insert(block);

  count_pages(pool, unmapped, block->stream, false);
}

void AllocatorCore::release_expandable_segment(Block* block) {
  // The whole segment is one unmapped block again: give its addresses back.
  assert(!block->mapped && block->size == segment_of(block).size());
  block->pool->unmapped.erase(block);
  expandable_[block->segment - 1u].reset();
  block_storage_.release(block);
}


// ---------------------------------------------------------------------------
// free

[[gnu::aligned(64)]] void AllocatorCore::free(void* ptr) {
  if (ptr == nullptr) [[unlikely]] return;  // as PyTorch's free(): nothing to do
  std::lock_guard guard(lock_);
  const auto key = reinterpret_cast<std::uintptr_t>(ptr);
  Block** found = active_.find(key);
  if (found == nullptr || !(*found)->allocated) {
    throw Error("deallocate: " + explain_unknown_pointer_locked(key) + "; nothing changed");
  }
  Block* block = *found;
  if (!block->stream_uses.empty()) [[unlikely]] {
    free_used_on_streams(found);
    return;
  }
  release_allocation(block, /*completed=*/true);
  active_.erase_found(found);  // no second probe in free_block
  pool_freed_block(block);
}

void AllocatorCore::release_allocation(Block* block, bool completed) noexcept {
  block->allocated = false;
  const std::size_t pi = pool_index(*block->pool);
  pool_stats_.allocation.decrease(pi, 1);
  pool_stats_.allocated_bytes.decrease(pi, static_cast<std::int64_t>(block->size));
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.decrease(1);
  if (instrumented_) [[unlikely]] {
    emit(TraceAction::FreeRequested, block, block->size, block->requested_size, completed);
  }
}

void AllocatorCore::free_used_on_streams(Block** found) {
  Block* block = *found;
  // Events first: if the device refuses one, the block is still allocated and
  // nothing else changed.
  const std::vector<std::pair<StreamId, EventId>> events = record_use_events(*block);
  block->stream_uses.clear();
  // The block stays active while its events are pending: from now on active differs from allocation.
  if (!events.empty() && !pool_stats_.active_tracked) pool_stats_.track_active();
  release_allocation(block, /*completed=*/events.empty());
  if (events.empty()) {  // every use-stream was destroyed and waited for
    active_.erase_found(found);
    free_block(block, /*report=*/false, /*in_map=*/false);
    return;
  }
  for (auto [stream, event] : events) {
    ++block->event_count;
    events_[stream].emplace_back(event, block);
  }
}

void AllocatorCore::free_block(Block* block, bool report, bool in_map) {
  assert(!block->allocated && block->event_count == 0 && block->stream_uses.empty());
  if (report && instrumented_) [[unlikely]] {
    emit(TraceAction::FreeCompleted, block, block->size, block->requested_size);
  }
  if (in_map) active_.erase(block->ptr);
  pool_freed_block(block);
}

[[gnu::always_inline]] inline void AllocatorCore::pool_freed_block(Block* block) {
  const std::size_t original_size = block->size;
  const std::size_t requested = block->requested_size;
  BlockPool& pool = *block->pool;
  const StreamId stream = block->stream;  // the segment's, hence the neighbours'

  // Coalesce with free neighbours. PyTorch keeps `block` and deletes the
  // neighbours; we keep a neighbour that is already in the pool so it can
  // usually stay where it is in its size class's tree (rekey). The resulting
  // layout is the same.
  Block* prev = block->prev != nullptr && block->prev->is_free() ? block->prev : nullptr;
  Block* next = block->next != nullptr && block->next->is_free() ? block->next : nullptr;
  const bool expandable = block->expandable();
  if (expandable) [[unlikely]] {  // unmapped neighbours stay apart (their own set)
    if (prev != nullptr && !prev->mapped) prev = nullptr;
    if (next != nullptr && !next->mapped) next = nullptr;
  }
  std::int64_t merged_blocks = 0;
  std::int64_t merged_bytes = 0;
  Block* result = block;
  if (next != nullptr) {
    // [prev?][block][next] -> next spans all of them.
    merged_blocks += 1;
    merged_bytes += static_cast<std::int64_t>(next->size);
    std::uintptr_t ptr = block->ptr;
    std::size_t size = next->size + block->size;
    next->prev = block->prev;
    if (prev != nullptr) {
      merged_blocks += 1;
      merged_bytes += static_cast<std::int64_t>(prev->size);
      ptr = prev->ptr;
      size += prev->size;
      next->prev = prev->prev;
      pool.erase(prev, stream);
      block_storage_.release(prev);
    }
    if (next->prev != nullptr) next->prev->next = next;
    block_storage_.release(block);
    result = next;
    pool.rekey(result, stream, ptr, size);
  } else if (prev != nullptr) {
    merged_blocks += 1;
    merged_bytes += static_cast<std::int64_t>(prev->size);
    prev->next = block->next;
    if (prev->next != nullptr) prev->next->prev = prev;
    const std::size_t size = prev->size + block->size;
    block_storage_.release(block);
    result = prev;
    pool.rekey(result, stream, prev->ptr, size);
  } else {
    block->requested_size = 0;
    block->context = 0;
    pool.insert(block);
  }

  // inactive_split counts free blocks that are only part of a segment.
  const std::int64_t net_blocks = (result->is_split() ? 1 : 0) - merged_blocks;
  const std::int64_t net_bytes =
      (result->is_split() ? static_cast<std::int64_t>(result->size) : 0) - merged_bytes;
  const std::size_t pi = pool_index(pool);
  if (!expandable) {
    pool_stats_.inactive_split.add(pi, net_blocks);
    pool_stats_.inactive_split_bytes.add(pi, net_bytes);
  }
  if (pool_stats_.active_tracked) [[unlikely]] {
    pool_stats_.active.decrease(pi, 1);
    pool_stats_.active_bytes.decrease(pi, static_cast<std::int64_t>(original_size));
  }
  pool_stats_.requested_bytes.decrease(pi, static_cast<std::int64_t>(requested));
}

// ---------------------------------------------------------------------------
// streams and events

void AllocatorCore::record_stream(void* ptr, StreamId stream) {
  std::lock_guard guard(lock_);
  Block** found = active_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr || !(*found)->allocated) {
    throw Error("record_stream: " +
                explain_unknown_pointer_locked(reinterpret_cast<std::uintptr_t>(ptr)) +
                "; nothing changed");
  }
  Block* block = *found;
  if (!device_->has_stream(stream)) {
    throw Error("record_stream: stream " + std::to_string(stream) +
                " is not a stream of this device (destroyed, or never created); nothing changed");
  }
  if (stream == block->stream) return;  // its own stream orders the reuse already
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

bool AllocatorCore::relabel(const void* ptr, std::uint32_t context) noexcept {
  std::lock_guard guard(lock_);
  Block** found = active_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr || !(*found)->allocated) return false;
  Block* block = *found;
  block->context = context;
  if (instrumented_) emit(TraceAction::Relabel, block, block->size, block->requested_size);
  return true;
}

std::vector<std::pair<StreamId, EventId>> AllocatorCore::record_use_events(const Block& block) {
  std::vector<std::pair<StreamId, EventId>> events;
  events.reserve(block.stream_uses.size());
  bool synchronized = false;
  try {
    for (StreamId s : block.stream_uses) {
      if (!device_->has_stream(s)) {
        // Destroyed since record_stream: no event can follow its work, so wait for
        // the whole device once (safe on a real GPU, where that work may still run).
        if (!synchronized) device_->synchronize();
        synchronized = true;
        continue;
      }
      const EventId event = device_->create_event();
      events.emplace_back(s, event);
      device_->record_event(event, s);
    }
  } catch (...) {
    for (auto [stream, event] : events) device_->destroy_event(event);
    throw;
  }
  return events;
}

void AllocatorCore::process_events() {
  // Per-stream queues: a slow stream does not hold up blocks of the others.
  for (auto it = events_.begin(); it != events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      auto [event, block] = queue.front();
      if (!device_->query_event(event)) break;
      device_->destroy_event(event);
      queue.pop_front();
      if (--block->event_count == 0) free_block(block);
    }
    it = queue.empty() ? events_.erase(it) : std::next(it);
  }
}

void AllocatorCore::synchronize_and_free_events() {
  ++stats_.num_sync_all_streams;
  for (auto& [stream, queue] : events_) {
    for (auto& [event, block] : queue) {
      device_->synchronize_event(event);
      device_->destroy_event(event);
      if (--block->event_count == 0) free_block(block);
    }
  }
  events_.clear();
}

// ---------------------------------------------------------------------------
// cache control, settings, observers

void AllocatorCore::empty_cache() {
  std::lock_guard guard(lock_);
  release_cached_blocks();
}

void AllocatorCore::load_module(std::string_view name, std::size_t bytes) {
  std::lock_guard guard(lock_);
  const std::optional<std::size_t> held = device_->load_module(name, bytes);
  if (!held) {
    const DeviceMemInfo mem = device_->mem_get_info();
    const OutOfMemoryError::Figures f = note_oom(mem, bytes, bytes, 0, nullptr);
    throw OutOfMemoryError("CUDA out of memory loading " + std::string(name) + " (" + format_bytes(bytes) +
                               " outside the allocator). GPU " + device_->info().name + " has " +
                               format_bytes(mem.free_bytes) + " free; " + format_bytes(f.allocated) +
                               " is allocated and " + format_bytes(f.reserved) +
                               " reserved by vramscope. Free cached blocks (empty_cache) or use a smaller batch.",
                           f);
  }
  // What the device now holds beyond the segments (a real GPU loads its own: 0 here).
  context_bytes_ += *held;
  stats_.context_bytes = static_cast<std::int64_t>(context_bytes_);
  update_device_view();
}

void AllocatorCore::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw Error("set_memory_fraction(" + std::to_string(fraction) +
                "): the fraction must be within [0, 1]; nothing changed");
  }
  std::lock_guard guard(lock_);
  allowed_memory_maximum_ = static_cast<std::size_t>(
      fraction * static_cast<double>(device_->info().total_bytes));
  set_fraction_ = true;
}

Block* AllocatorCore::plain_segment_locked(std::size_t bytes, StreamId stream, bool small_pool) {
  AllocParams p;
  p.size = p.alloc_size = bytes;
  p.stream = stream;
  p.pool = small_pool ? &small_blocks_ : &large_blocks_;
  p.plain_segment = true;
  return alloc_block(p, false) ? p.block : nullptr;
}

std::uintptr_t AllocatorCore::reserve_segment(std::size_t bytes, StreamId stream, bool small_pool) {
  if (bytes == 0 || bytes % kMinBlockSize != 0 || bytes > kMaxRequestSize) {
    throw Error("reserve_segment(" + std::to_string(bytes) +
                " B): size must be a positive multiple of 512 B");
  }
  std::lock_guard guard(lock_);
  Block* block = plain_segment_locked(bytes, stream, small_pool);
  if (block == nullptr) throw Error("reserve_segment(" + format_bytes(bytes) + "): the device has no room for it");
  block->pool->insert(block);
  return block->ptr;
}

std::size_t AllocatorCore::largest_free_block() const {
  std::lock_guard guard(lock_);
  std::size_t largest = std::max(large_blocks_.largest_size(), small_blocks_.largest_size());
  for (const auto& [id, pool] : private_pools_) {
    largest = std::max({largest, pool->large.largest_size(), pool->small.largest_size()});
  }
  return largest;
}

namespace {
/// Throws unless `live` are ascending, non-overlapping 512 B multiples inside `bytes`.
void check_restored_layout(const std::string& what, std::size_t bytes,
                           const std::vector<CachingAllocator::RestoredBlock>& live) {
  if (bytes == 0 || bytes % kMinBlockSize != 0 || bytes > kMaxRequestSize) {
    throw Error(what + ": size must be a positive multiple of 512 B");
  }
  std::size_t end = 0;
  for (std::size_t i = 0; i < live.size(); ++i) {
    const CachingAllocator::RestoredBlock& b = live[i];
    if (b.size == 0 || b.size % kMinBlockSize != 0 || b.offset % kMinBlockSize != 0 || b.offset < end ||
        b.offset > bytes || b.size > bytes - b.offset || b.requested > b.size) {
      throw Error(what + ": block " + std::to_string(i) + " (offset " + std::to_string(b.offset) + ", " +
                  std::to_string(b.size) + " B, requested " + std::to_string(b.requested) +
                  " B) is not a multiple of 512 inside the segment after the previous block");
    }
    end = b.offset + b.size;
  }
}
}  // namespace

std::vector<void*> AllocatorCore::carve_restored(Block* whole, const std::vector<CachingAllocator::RestoredBlock>& live) {
  BlockPool& pool = *whole->pool;
  const std::size_t pi = pool_index(pool);
  const StreamId stream = whole->stream;
  const std::uintptr_t origin = whole->ptr;
  // Cut from the front: [gap][live][gap][live]...[rest].
  const auto cut = [&](Block* from, std::size_t size) {  // `from` keeps the front `size` bytes
    Block* back = new_block(from->ptr + size, from->size - size, stream, &pool, from->segment, true);
    splice_after(from, back);
    from->size = size;
    return back;
  };
  std::vector<void*> out;
  std::vector<Block*> gaps;
  out.reserve(live.size());
  Block* rest = whole;
  for (const CachingAllocator::RestoredBlock& b : live) {
    const std::uintptr_t at = origin + b.offset;
    if (at > rest->ptr) {
      Block* gap = rest;
      rest = cut(gap, at - gap->ptr);
      gaps.push_back(gap);
    }
    Block* block = rest;
    rest = block->size > b.size ? cut(block, b.size) : nullptr;
    hand_out(block, b.requested > 0 ? b.requested : b.size, pi);
    out.push_back(reinterpret_cast<void*>(block->ptr));
    if (rest == nullptr) break;  // the layout was checked: nothing follows a block that ends the range
  }
  if (rest != nullptr) gaps.push_back(rest);
  for (Block* gap : gaps) {
    if (gap->expandable()) {
      // A gap at the range's edge meets a free mapped block of a neighbouring range.
      try_merge_blocks(gap, gap->prev, pool);
      try_merge_blocks(gap, gap->next, pool);
      pool.insert(gap);
    } else {
      pool.insert(gap);
      if (gap->is_split()) {  // inactive_split counts free blocks that are only part of a segment
        pool_stats_.inactive_split.increase(pi, 1);
        pool_stats_.inactive_split_bytes.increase(pi, static_cast<std::int64_t>(gap->size));
      }
    }
  }
  return out;
}

std::vector<void*> AllocatorCore::restore_segment(std::size_t bytes, StreamId stream, bool small_pool,
                                                  const std::vector<CachingAllocator::RestoredBlock>& live) {
  const std::string what = "restore_segment(" + format_bytes(bytes) + ")";
  check_restored_layout(what, bytes, live);
  std::lock_guard guard(lock_);
  Block* whole = plain_segment_locked(bytes, stream, small_pool);
  if (whole == nullptr) throw Error(what + ": the device has no room for it");
  return carve_restored(whole, live);
}

std::uintptr_t AllocatorCore::expandable_segment_base(StreamId stream, bool small_pool) {
  if (!config_.expandable_segments) {
    throw Error("expandable_segment_base: this allocator runs without expandable_segments:True");
  }
  std::lock_guard guard(lock_);
  BlockPool& pool = small_pool ? small_blocks_ : large_blocks_;
  for (const auto& segment : expandable_) {
    if (segment != nullptr && segment->stream() == stream && segment->page() == page_size(pool)) {
      return segment->base();
    }
  }
  Block* whole = new_expandable_segment(stream, pool);
  if (whole == nullptr) throw Error("expandable_segment_base: no room for another expandable segment");
  return whole->ptr;
}

std::vector<void*> AllocatorCore::restore_expandable(std::size_t offset, std::size_t bytes, StreamId stream,
                                                     bool small_pool,
                                                     const std::vector<CachingAllocator::RestoredBlock>& live) {
  const std::string what = "restore_expandable(+" + std::to_string(offset) + ", " + format_bytes(bytes) + ")";
  check_restored_layout(what, bytes, live);
  const std::size_t page = page_size(small_pool ? small_blocks_ : large_blocks_);
  if (offset % page != 0 || bytes % page != 0) {
    throw Error(what + ": an expandable range is whole " + format_bytes(page) + " pages");
  }
  const std::uintptr_t base = expandable_segment_base(stream, small_pool);
  std::lock_guard guard(lock_);
  BlockPool& pool = small_pool ? small_blocks_ : large_blocks_;
  const std::uintptr_t at = base + offset;
  // The unmapped block holding the range.
  Block key;
  key.stream = stream;
  key.ptr = at;
  auto it = pool.unmapped.upper_bound(&key);
  Block* holder = it == pool.unmapped.begin() ? nullptr : *std::prev(it);
  if (holder == nullptr || holder->stream != stream || holder->ptr > at || holder->ptr + holder->size < at + bytes ||
      segment_of(holder).base() != base) {
    throw Error(what + ": the range is not unmapped address space of the segment");
  }
  ExpandableSegment& segment = segment_of(holder);
  if (segment.map(at, bytes).size == 0) throw Error(what + ": the device has no room for it");
  // Split the holder into [unmapped][range][unmapped].
  pool.unmapped.erase(holder);
  if (holder->ptr < at) {
    Block* front = new_block(holder->ptr, at - holder->ptr, stream, &pool, holder->segment, false);
    splice_before(holder, front);
    holder->size -= front->size;
    holder->ptr = at;
    pool.unmapped.insert(front);
  }
  if (holder->size > bytes) {
    Block* back = new_block(at + bytes, holder->size - bytes, stream, &pool, holder->segment, false);
    splice_after(holder, back);
    holder->size = bytes;
    pool.unmapped.insert(back);
  }
  holder->mapped = true;
  count_pages(pool, AddressRange{at, bytes}, stream, true);
  return carve_restored(holder, live);
}

void AllocatorCore::add_observer(AllocatorObserver* observer) {
  if (observer == nullptr) throw Error("add_observer(nullptr)");
  std::lock_guard guard(lock_);
  if (std::find(observers_.begin(), observers_.end(), observer) == observers_.end()) {
    observers_.push_back(observer);
  }
  update_instrumented();
}

void AllocatorCore::remove_observer(AllocatorObserver* observer) noexcept {
  std::lock_guard guard(lock_);
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
  update_instrumented();
}

void AllocatorCore::attach_ring(EventRing* ring) {
  if (ring == nullptr) throw Error("attach_ring(nullptr)");
  std::lock_guard guard(lock_);
  if (std::find(rings_.begin(), rings_.end(), ring) == rings_.end()) rings_.push_back(ring);
  update_instrumented();
}

void AllocatorCore::detach_ring(EventRing* ring) noexcept {
  std::lock_guard guard(lock_);
  rings_.erase(std::remove(rings_.begin(), rings_.end(), ring), rings_.end());
  update_instrumented();
}

void AllocatorCore::set_context_source(ContextSource source) noexcept {
  std::lock_guard guard(lock_);
  context_source_ = source;
}

std::size_t AllocatorCore::device_rounded(std::size_t bytes) const noexcept {
  return (bytes + granularity_ - 1) / granularity_ * granularity_;
}

void AllocatorCore::update_device_view() noexcept {
  Stat& s = stats_.device_used_bytes;
  const auto now = static_cast<std::int64_t>(context_bytes_ + total_reserved_rounded_);
  if (now > s.current) s.increase(now - s.current);
  if (now < s.current) s.decrease(s.current - now);
}

void AllocatorCore::emit(TraceAction action, const Block* b, std::size_t size,
                         std::size_t requested, bool completed) noexcept {
  const std::uint64_t sequence = ++sequence_;
  if (completed) ++sequence_;  // the number of the implied free_completed
  const auto event = [&] {
    TraceEvent e;
    e.action = action;
    e.completed = completed;
    e.address = b->ptr;
    e.size = size;
    e.requested_size = requested;
    e.stream = b->stream;
    e.context = b->context;
    e.small_pool = b->pool != nullptr && b->pool->is_small;
    e.allocated_bytes = static_cast<std::size_t>(pool_stats_.allocated_bytes.current());
    e.reserved_bytes = static_cast<std::size_t>(pool_stats_.reserved_bytes.current());
    e.device_used_bytes = static_cast<std::size_t>(stats_.device_used_bytes.current);
    e.sequence = sequence;
    return e;
  };
  // One event per consumer: inlined into the ring's stores, an event never
  // touches the stack; only an observer call needs one in memory.
  for (EventRing* ring : rings_) ring->record(event());
  if (!observers_.empty()) notify_observers(event());
}

void AllocatorCore::notify_observers(const TraceEvent& e) noexcept {
  for (AllocatorObserver* o : observers_) o->on_event(e);
}

void AllocatorCore::emit_segment(TraceAction action, std::uintptr_t ptr, std::size_t size,
                                 StreamId stream, bool small, std::uint32_t context) noexcept {
  Block b;
  b.ptr = ptr;
  b.context = context;
  b.stream = stream;
  b.pool = small ? &small_blocks_ : &large_blocks_;
  emit(action, &b, size, 0);
}

}  // namespace mem::detail
