// expandable_segment.hpp — one expandable segment's address space and pages (internal).
//
// PyTorch's ExpandableSegment (c10/cuda/CUDACachingAllocator.cpp): per stream and
// pool, address space for 1 1/8 of the device's memory is reserved once, and
// physical pages (2 MiB in the small pool, 20 MiB in the large) are created and
// mapped into it as the segment grows, one driver allocation per page, and
// unmapped when whole pages fall free. The blocks that tile it live in the
// allocator; this class knows only which pages are mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vramscope/allocator/device.hpp"

namespace mem::detail {

struct AddressRange {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;  ///< 0: nothing (a refused map, an unmap with no whole page)
};

class ExpandableSegment {
 public:
  /// Reserves ceil(device total * 9/8 / page) pages of addresses. Throws mem::Error when
  /// the device has no address space left.
  ExpandableSegment(Device& device, StreamId stream, std::size_t page);
  ~ExpandableSegment();  ///< unmaps every mapped page and releases the addresses
  ExpandableSegment(const ExpandableSegment&) = delete;
  ExpandableSegment& operator=(const ExpandableSegment&) = delete;

  /// The addresses one segment with `page`-sized pages reserves on `device`.
  static std::size_t size_for(const Device& device, std::size_t page) noexcept;

  std::uintptr_t base() const noexcept { return base_; }
  std::size_t size() const noexcept { return page_ * pages_; }
  std::size_t page() const noexcept { return page_; }
  StreamId stream() const noexcept { return stream_; }

  /// Maps the pages covering [ptr, ptr + bytes), `ptr` on a page boundary: the range mapped
  /// (whole pages, so possibly more than asked), or size 0 when the device is out of memory,
  /// in which case nothing stays mapped (PyTorch's map(): all or nothing).
  AddressRange map(std::uintptr_t ptr, std::size_t bytes);
  /// Unmaps the pages lying wholly inside [ptr, ptr + bytes): the range unmapped, size 0
  /// when no whole page lies inside.
  AddressRange unmap(std::uintptr_t ptr, std::size_t bytes);
  /// Whether every page [ptr, ptr + bytes) touches is mapped (`want`) or unmapped.
  bool pages_are(std::uintptr_t ptr, std::size_t bytes, bool want) const noexcept;
  bool any_mapped() const noexcept { return !mapped_.empty(); }

 private:
  std::size_t page_left(std::uintptr_t p) const noexcept { return (p - base_) / page_; }
  std::size_t page_right(std::uintptr_t p) const noexcept { return (p - base_ + page_ - 1) / page_; }
  void unmap_pages(std::size_t begin, std::size_t end) noexcept;
  void trim() noexcept;

  Device& device_;
  StreamId stream_;
  std::size_t page_;
  std::size_t pages_ = 0;
  std::uintptr_t base_ = 0;
  /// Page i mapped; trimmed after its last mapped page (PyTorch's handles_).
  std::vector<bool> mapped_;
};

}  // namespace mem::detail
