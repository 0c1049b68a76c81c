// errors.cpp — messages safe to print, whatever bytes the user's files put in them.
#include "vramscope/allocator/errors.hpp"

#include <cstdio>

namespace mem {

namespace {

// Length of the valid UTF-8 sequence at text[i] (1-4), or 0 when it is not one: overlong
// forms, surrogates and code points past U+10FFFF are not UTF-8 either.
std::size_t utf8_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      if (const std::size_t n = utf8_length(text, i); n != 0) {
        out.append(text.substr(i, n));
        i += n;
        continue;
      }
    } else if ((c >= 0x20 && c != 0x7F) || c == '\n' || c == '\t') {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    char escaped[5];
    std::snprintf(escaped, sizeof escaped, "\\x%02X", c);
    out += escaped;
    ++i;
  }
  return out;
}

}  // namespace mem
