// device.cpp — what every Device does the same way: mapping runs of pages call by call.
#include "vramscope/allocator/device.hpp"

namespace mem {

bool Device::map_pages(void* address, std::size_t count, std::size_t page) {
  char* const base = static_cast<char*>(address);
  std::size_t mapped = 0;
  try {
    while (mapped < count && map_memory(base + mapped * page, page)) ++mapped;
  } catch (...) {
    unmap_pages(address, mapped, page);
    throw;
  }
  if (mapped == count) return true;
  unmap_pages(address, mapped, page);  // all or nothing, as PyTorch's map()
  return false;
}

void Device::unmap_pages(void* address, std::size_t count, std::size_t page) noexcept {
  char* const base = static_cast<char*>(address);
  for (std::size_t i = 0; i < count; ++i) unmap_memory(base + i * page, page);
}

}  // namespace mem
