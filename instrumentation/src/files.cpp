// files.cpp — the files users name: inputs checked before they are read, text read a bounded
// line at a time, outputs written without replacing a device, a link or half a file.
#include "vramscope/instrumentation/files.hpp"

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem {

namespace {

// The file as the process's stdout or stderr has it open (`--plot /dev/stdout > log.txt`, or
// the log's own file named again): written through that descriptor, after what the process
// printed so far, so nothing is truncated, replaced or written over. -1 when it is neither.
int standard_stream_of(const std::filesystem::path& path) {
  struct stat target {};
  if (::stat(path.c_str(), &target) != 0) return -1;
  for (const int fd : {1, 2}) {
    struct stat open_as {};
    if (::fstat(fd, &open_as) == 0 && open_as.st_dev == target.st_dev && open_as.st_ino == target.st_ino) return fd;
  }
  return -1;
}

void write_all(int fd, const std::string& shown, std::string_view content, std::string_view what) {
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(std::string(what) + ": writing '" + shown + "' failed after " + std::to_string(done) + " of " +
                  std::to_string(content.size()) + " bytes: " + std::strerror(n < 0 ? errno : EIO));
    }
    done += static_cast<std::size_t>(n);
  }
}

// Opens `path` as given (a link is followed by the system, its target created when missing)
// and writes `content`: for a device, a FIFO, a symbolic link and a standard stream, which
// must be written, never replaced (renaming over /dev/null would make it a regular file for
// every program on the machine; over a link, the link would be gone).
void write_through(const std::filesystem::path& path, int flags, std::string_view content, std::string_view what) {
  const std::string shown = path.string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | flags, 0666);
  if (fd < 0) {
    throw Error(std::string(what) + ": cannot write '" + shown + "': " + std::strerror(errno));
  }
  try {
    write_all(fd, shown, content, what);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0 && errno != EINTR) {
    throw Error(std::string(what) + ": writing '" + shown + "' failed: " + std::strerror(errno));
  }
}

}  // namespace

void write_output_file(const std::filesystem::path& path, std::string_view content, std::string_view what) {
  namespace fs = std::filesystem;
  if (path.empty()) throw Error(std::string(what) + ": the output path is empty");
  const std::string shown = path.string();
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);  // follows links
  if (ec == std::errc::too_many_symbolic_link_levels) {
    throw Error(std::string(what) + ": cannot write '" + shown + "': its symbolic links form a loop");
  }
  if (fs::is_directory(status)) {
    throw Error(std::string(what) + ": cannot write '" + shown + "': it is a directory");
  }
  if (const int fd = standard_stream_of(path); fd >= 0) {
    std::cout.flush();  // what was printed comes first
    std::cerr.flush();
    std::fflush(nullptr);
    return write_all(fd, shown, content, what);
  }
  if (fs::exists(status) && !fs::is_regular_file(status)) return write_through(path, 0, content, what);
  if (fs::is_symlink(fs::symlink_status(path, ec))) return write_through(path, O_CREAT | O_TRUNC, content, what);
  const auto parent = path.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    throw Error(std::string(what) + ": cannot write '" + shown + "': directory '" + parent.string() +
                "' does not exist; create it or choose another path");
  }
  // A regular file is written beside the target and renamed over it: a failed write leaves
  // no truncated file, and readers never see a half-written one.
  // The name is unique to this write (process id and a counter), so threads writing the
  // same path never share a temporary file; the last rename wins, whole.
  static std::atomic<std::uint64_t> writes{0};
  fs::path temp = path;
  temp += ".vramscope-" + std::to_string(::getpid()) + "-" + std::to_string(++writes) + ".tmp";
  std::ofstream out(temp, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw Error(std::string(what) + ": cannot write '" + shown + "' (its temporary file '" + temp.string() +
                "' did not open: " + std::strerror(errno) + ")");
  }
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  out.close();
  if (!out) {
    const int err = errno;
    fs::remove(temp, ec);
    throw Error(std::string(what) + ": writing '" + shown + "' failed (" + std::to_string(content.size()) +
                " bytes): " + std::strerror(err));
  }
  fs::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error(std::string(what) + ": cannot write '" + shown + "': " + ec.message());
  }
}

void check_input_file(const std::filesystem::path& path, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  const std::string head = std::string(what) + " '" + path.string() + "'";
  if (!fs::exists(status)) {
    throw Error(head + " does not exist" + (ec && ec != std::errc::no_such_file_or_directory
                                                 ? " or cannot be reached (" + ec.message() + ")"
                                                 : std::string{}));
  }
  if (fs::is_regular_file(status)) return;
  const char* kind = fs::is_directory(status)       ? "a directory"
                     : fs::is_fifo(status)          ? "a FIFO (named pipe)"
                     : fs::is_socket(status)        ? "a socket"
                     : fs::is_character_file(status) ? "a character device"
                     : fs::is_block_file(status)    ? "a block device"
                                                    : "not a regular file";
  throw Error(head + " is " + kind + "; vramscope reads only regular files (write it to a file first)");
}

bool read_line(std::istream& in, std::string& line, const std::string& what, std::size_t line_number,
               std::size_t max_bytes) {
  line.clear();
  std::streambuf* buf = in.rdbuf();
  if (buf == nullptr) {
    in.setstate(std::ios::badbit);
    return false;
  }
  bool any = false;
  for (;;) {
    const int c = buf->sbumpc();
    if (c == std::char_traits<char>::eof()) {
      in.setstate(any ? std::ios::eofbit : std::ios::eofbit | std::ios::failbit);
      return any;
    }
    any = true;
    if (c == '\n') return true;
    if (line.size() == max_bytes) {
      throw Error(what + ": line " + std::to_string(line_number) + " is longer than " + format_bytes(max_bytes) +
                  "; a row of this format is a few hundred bytes (a broken or hostile file?)");
    }
    line.push_back(static_cast<char>(c));
  }
}

}  // namespace mem
