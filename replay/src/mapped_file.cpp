// mapped_file.cpp — mmap of a regular file, and giving back the pages read.
#include "mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mem::detail {

std::unique_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st {};
  void* p = MAP_FAILED;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  }
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) return nullptr;
  ::madvise(p, static_cast<std::size_t>(st.st_size), MADV_SEQUENTIAL);
  return std::unique_ptr<MappedFile>(new MappedFile(static_cast<const char*>(p), static_cast<std::size_t>(st.st_size)));
}

MappedFile::~MappedFile() { ::munmap(const_cast<char*>(data_), size_); }

void MappedFile::release_before(const char* upto) noexcept {
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t end = static_cast<std::size_t>(upto - data_) / static_cast<std::size_t>(page) *
                          static_cast<std::size_t>(page);
  if (end <= released_) return;
  ::madvise(const_cast<char*>(data_) + released_, end - released_, MADV_DONTNEED);
  released_ = end;
}

}  // namespace mem::detail
