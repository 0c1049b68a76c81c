// usage_error.hpp — bad input on the command line. main() prints the message on
// one line and exits with code 2; commands throw, they never exit().
#pragma once

#include <stdexcept>
#include <string>

#include "vramscope/allocator/errors.hpp"

namespace mem::tools {

/// Exit code for bad input (unknown names, malformed sizes, impossible options).
inline constexpr int kExitUsage = 2;
/// Exit code for a run that failed (out of memory in `trace`, an unwritable file).
inline constexpr int kExitFailure = 1;

/// The user asked for something that cannot be; the message names what is valid.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Flattens a message to one line (the command's errors are one line each).
std::string one_line(std::string text);

/// Runs `fn`; a mem::Error it throws (the libraries' parsers reject unknown names
/// and malformed values with one) becomes a UsageError prefixed with `option`.
template <class F>
decltype(auto) as_usage(const std::string& option, F&& fn) {
  try {
    return fn();
  } catch (const mem::Error& e) {
    throw UsageError(option + ": " + one_line(e.what()));
  }
}

}  // namespace mem::tools
