// mapped_file.hpp — a file's bytes mapped read-only, for reading a large snapshot in
// one pass (internal).
//
// The kernel pages the file in as the reader reaches it, and release_before() gives
// back the pages already read (they come back from the page cache if a view into them
// is read again), so a pass over a file of any size keeps only a window of it resident.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace mem::detail {

class MappedFile {
 public:
  /// nullptr where the file cannot be mapped (a pipe, a directory, an empty file): the
  /// caller reads it instead, with that path's error messages.
  static std::unique_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::string_view bytes() const noexcept { return {data_, size_}; }
  /// The pages wholly before `upto` (a pointer into bytes()) stop counting as resident.
  void release_before(const char* upto) noexcept;

 private:
  MappedFile(const char* data, std::size_t size) : data_(data), size_(size) {}
  const char* data_;
  std::size_t size_;
  std::size_t released_ = 0;  // bytes from the start already given back
};

}  // namespace mem::detail
