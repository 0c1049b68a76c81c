// file_output.hpp — writing an export to disk with errors that name the path.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace mem::detail {

/// Writes `content` to `path`: a regular file is replaced whole (written beside it, then
/// renamed); a device, a FIFO and a symbolic link are written through (the link stays, its
/// target is written or created); the file stdout or stderr writes is appended to.
/// Throws mem::Error saying which export, which path and why (missing directory,
/// permission, disk full).
void write_file(const std::filesystem::path& path, std::string_view content, std::string_view what);

/// Text that can sit inside XML/SVG markup.
std::string xml_escape(std::string_view text);

}  // namespace mem::detail
