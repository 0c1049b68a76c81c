// errors.cpp — one-line error messages.
#include "vramscope/planner/errors.hpp"

namespace mem::planner {

std::string one_line(std::string text) {
  for (char& ch : text) {
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  }
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

}  // namespace mem::planner
