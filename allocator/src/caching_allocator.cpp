// caching_allocator.cpp — the public CachingAllocator facade over
// AllocatorCore, and the process-wide allocator applications link in.
#include "vramscope/allocator/caching_allocator.hpp"

#include <cstdlib>
#include <mutex>

#include "allocator_core.hpp"

namespace mem {

CachingAllocator::CachingAllocator(std::shared_ptr<Device> device, AllocatorConfig config)
    : core_(std::make_unique<detail::AllocatorCore>(std::move(device), config)) {}
CachingAllocator::~CachingAllocator() = default;

void* CachingAllocator::allocate(std::size_t bytes, StreamId stream) {
  return core_->malloc(bytes, stream);
}
void CachingAllocator::deallocate(void* ptr) { core_->free(ptr); }
void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  core_->record_stream(ptr, stream);
}
bool CachingAllocator::relabel(const void* ptr, std::uint32_t context) noexcept {
  return core_->relabel(ptr, context);
}
void CachingAllocator::empty_cache() { core_->empty_cache(); }
PoolId CachingAllocator::graph_pool_handle() noexcept { return core_->graph_pool_handle(); }
void CachingAllocator::begin_allocate_to_pool(PoolId pool, StreamId stream) {
  core_->begin_allocate_to_pool(pool, stream);
}
void CachingAllocator::end_allocate_to_pool(PoolId pool) { core_->end_allocate_to_pool(pool); }
void CachingAllocator::release_pool(PoolId pool) { core_->release_pool(pool); }
std::size_t CachingAllocator::private_pool_reserved() const { return core_->private_pool_bytes(false); }
std::size_t CachingAllocator::private_pool_allocated() const { return core_->private_pool_bytes(true); }
void CachingAllocator::load_module(std::string_view name, std::size_t bytes) { core_->load_module(name, bytes); }
void CachingAllocator::set_memory_fraction(double fraction) {
  core_->set_memory_fraction(fraction);
}
DeviceStats CachingAllocator::stats() const { return core_->stats(); }
void CachingAllocator::reset_peak_stats() { core_->reset_peak_stats(); }
void CachingAllocator::reset_accumulated_stats() { core_->reset_accumulated_stats(); }
std::vector<SegmentInfo> CachingAllocator::segments() const { return core_->segments(); }
std::vector<SegmentInfo> CachingAllocator::segments(DeviceStats& stats) const {
  return core_->segments(&stats);
}
std::size_t CachingAllocator::block_size(const void* ptr) const { return core_->block_size(ptr); }
bool CachingAllocator::owns(const void* ptr) const noexcept { return core_->owns(ptr); }

std::size_t CachingAllocator::largest_free_block() const { return core_->largest_free_block(); }
void CachingAllocator::validate() const { core_->validate(); }
void CachingAllocator::add_observer(AllocatorObserver* observer) { core_->add_observer(observer); }
void CachingAllocator::remove_observer(AllocatorObserver* observer) noexcept {
  core_->remove_observer(observer);
}
void CachingAllocator::attach_ring(EventRing* ring) { core_->attach_ring(ring); }
void CachingAllocator::detach_ring(EventRing* ring) noexcept { core_->detach_ring(ring); }
void CachingAllocator::set_context_source(ContextSource source) noexcept {
  core_->set_context_source(source);
}
std::uintptr_t CachingAllocator::reserve_segment(std::size_t bytes, StreamId stream,
                                                 bool small_pool) {
  return core_->reserve_segment(bytes, stream, small_pool);
}

std::vector<void*> CachingAllocator::restore_segment(std::size_t bytes, StreamId stream, bool small_pool,
                                                     const std::vector<RestoredBlock>& live) {
  return core_->restore_segment(bytes, stream, small_pool, live);
}

std::vector<void*> CachingAllocator::restore_expandable(std::size_t offset, std::size_t bytes, StreamId stream,
                                                        bool small_pool, const std::vector<RestoredBlock>& live) {
  return core_->restore_expandable(offset, bytes, stream, small_pool, live);
}

std::uintptr_t CachingAllocator::expandable_segment_base(StreamId stream, bool small_pool) {
  return core_->expandable_segment_base(stream, small_pool);
}
Device& CachingAllocator::device() const noexcept { return core_->device(); }
std::shared_ptr<Device> CachingAllocator::device_ptr() const noexcept {
  return core_->device_ptr();
}
const AllocatorConfig& CachingAllocator::config() const noexcept { return core_->config(); }

CachingAllocator& process_allocator() {
  // Leaked on purpose: tensors in static objects may outlive main().
  static CachingAllocator* instance = [] {
    const char* spec = std::getenv("VRAMSCOPE_DEVICE");
    return new CachingAllocator(make_device(spec ? spec : "auto"), AllocatorConfig::from_env());
  }();
  return *instance;
}

}  // namespace mem
