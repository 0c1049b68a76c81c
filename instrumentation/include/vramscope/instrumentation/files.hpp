// files.hpp — the files a user names: inputs checked before they are opened (a FIFO
// would block, a device would never end), outputs written without ever replacing a
// device, a link or half a file.
#pragma once

#include <cstddef>
#include <filesystem>
#include <iosfwd>
#include <string>
#include <string_view>

namespace mem {

/// Throws mem::Error unless `path` is a regular file that exists (symbolic links followed):
/// a directory, a FIFO, a socket or a device is refused with a message naming `what`
/// ("the model file") and the kind of file it is. Reading a named pipe would wait for a
/// writer forever; /dev/zero would never end.
void check_input_file(const std::filesystem::path& path, std::string_view what);

/// Writes `content` to `path` as every export here does: a regular file is replaced whole
/// (written beside it, then renamed: never left half-written); a device, a FIFO and a
/// symbolic link are written through (never replaced; a link's missing target is created);
/// the file this process's stdout or stderr writes (`/dev/stdout > log.txt`) is appended to. Throws mem::Error naming
/// `what`, the path and the cause (missing directory, permission, disk full).
void write_output_file(const std::filesystem::path& path, std::string_view content, std::string_view what);

/// The longest line a text trace may have: a CSV row of a history or an RMM log is a few
/// hundred bytes; a gigabyte "line" is a hostile or broken file, not a row to hold.
inline constexpr std::size_t kMaxTextLine = std::size_t{1} << 20;

/// std::getline with a bound: reads the next line of `in` without its '\n' into `line`;
/// false at the end of the input. A line longer than `max_bytes` throws mem::Error naming
/// `what` and the line's number `line_number` (read no further than the bound).
bool read_line(std::istream& in, std::string& line, const std::string& what, std::size_t line_number,
               std::size_t max_bytes = kMaxTextLine);

}  // namespace mem
