// usage_error.cpp — one-line error messages for the command.
#include "usage_error.hpp"

namespace mem::tools {

std::string one_line(std::string text) {
  for (char& ch : text) {
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  }
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

}  // namespace mem::tools
