// expandable_segment.cpp — reserving, mapping and unmapping an expandable segment's pages.
#include "expandable_segment.hpp"

#include <algorithm>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::detail {

std::size_t ExpandableSegment::size_for(const Device& device, std::size_t page) noexcept {
  // "we allocate enough address space for 1 1/8 the total memory on the GPU. This allows
  // for some cases where we have to unmap pages earlier in the segment to put them at the
  // end." (PyTorch's ExpandableSegment constructor)
  const std::size_t total = device.info().total_bytes;
  return std::max<std::size_t>((total + total / 8 + page - 1) / page, 1) * page;
}

ExpandableSegment::ExpandableSegment(Device& device, StreamId stream, std::size_t page)
    : device_(device), stream_(stream), page_(page) {
  pages_ = size_for(device, page) / page;
  void* base = device.reserve_address_range(size());
  if (base == nullptr) {
    throw Error("expandable segments: the device has no address space left for another " +
                format_bytes(size()) + " range");
  }
  base_ = reinterpret_cast<std::uintptr_t>(base);
}

ExpandableSegment::~ExpandableSegment() {
  // Each run of mapped pages at once: the pages were mapped one call each, and are unmapped so.
  std::size_t i = 0;
  while (i < mapped_.size()) {
    const std::size_t begin = i;
    while (i < mapped_.size() && mapped_[i]) ++i;
    if (i > begin) device_.unmap_pages(reinterpret_cast<void*>(base_ + begin * page_), i - begin, page_);
    while (i < mapped_.size() && !mapped_[i]) ++i;
  }
  device_.release_address_range(reinterpret_cast<void*>(base_), size());
}

AddressRange ExpandableSegment::map(std::uintptr_t ptr, std::size_t bytes) {
  const std::size_t begin = page_left(ptr);
  const std::size_t end = std::min(page_right(ptr + bytes), pages_);
  if (begin >= end) return {ptr, 0};
  // One physical allocation per page, as PyTorch creates one handle per page. Out of memory,
  // or a driver error (thrown), leaves nothing of this call mapped. The page flags grow first:
  // once the device has mapped the pages, nothing may fail before they are recorded.
  if (mapped_.size() < end) mapped_.resize(end, false);
  bool ok = false;
  try {
    ok = device_.map_pages(reinterpret_cast<void*>(base_ + begin * page_), end - begin, page_);
  } catch (...) {
    trim();
    throw;
  }
  if (!ok) {
    trim();
    return {base_ + begin * page_, 0};
  }
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(begin), mapped_.begin() + static_cast<std::ptrdiff_t>(end),
            true);
  return {base_ + begin * page_, (end - begin) * page_};
}

AddressRange ExpandableSegment::unmap(std::uintptr_t ptr, std::size_t bytes) {
  const std::size_t begin = page_right(ptr);
  const std::size_t end = page_left(ptr + bytes);
  if (begin >= end) return {ptr, 0};
  unmap_pages(begin, end);
  trim();
  return {base_ + begin * page_, (end - begin) * page_};
}

bool ExpandableSegment::pages_are(std::uintptr_t ptr, std::size_t bytes, bool want) const noexcept {
  if (ptr < base_ || ptr + bytes > base_ + size() || bytes == 0) return false;
  for (std::size_t i = page_left(ptr); i < page_right(ptr + bytes); ++i) {
    const bool is = i < mapped_.size() && mapped_[i];
    if (is != want) return false;
  }
  return true;
}

void ExpandableSegment::unmap_pages(std::size_t begin, std::size_t end) noexcept {
  device_.unmap_pages(reinterpret_cast<void*>(base_ + begin * page_), end - begin, page_);
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(begin), mapped_.begin() + static_cast<std::ptrdiff_t>(end),
            false);
}

void ExpandableSegment::trim() noexcept {
  while (!mapped_.empty() && !mapped_.back()) mapped_.pop_back();
}

}  // namespace mem::detail
