// file_output.cpp — writing exports to disk.
#include "file_output.hpp"

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include <unistd.h>

#include "vramscope/allocator/errors.hpp"

namespace mem::detail {

void write_file(const std::filesystem::path& path, std::string_view content, std::string_view what) {
  if (path.empty()) throw Error(std::string(what) + ": the output path is empty");
  std::error_code ec;
  const auto parent = path.parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
    throw Error(std::string(what) + ": cannot write '" + path.string() + "': directory '" +
                parent.string() + "' does not exist; create it or choose another path");
  }
  // Written beside the target and renamed over it: a failed write leaves no truncated file,
  // and readers never see a half-written one.
  // The name is unique to this write (process id and a counter), so threads writing the
  // same path never share a temporary file; the last rename wins, whole.
  static std::atomic<std::uint64_t> writes{0};
  std::filesystem::path temp = path;
  temp += ".vramscope-" + std::to_string(::getpid()) + "-" + std::to_string(++writes) + ".tmp";
  std::ofstream out(temp, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw Error(std::string(what) + ": cannot write '" + path.string() + "' (its temporary file '" +
                temp.string() + "' did not open: " + std::strerror(errno) + ")");
  }
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  out.close();
  if (!out) {
    const int err = errno;
    std::filesystem::remove(temp, ec);
    throw Error(std::string(what) + ": writing '" + path.string() + "' failed (" +
                std::to_string(content.size()) + " bytes): " + std::strerror(err));
  }
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(temp, ignored);
    throw Error(std::string(what) + ": cannot write '" + path.string() + "': " + ec.message());
  }
}

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace mem::detail
