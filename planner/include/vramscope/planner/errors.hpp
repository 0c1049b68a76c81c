// errors.hpp — how the planner refuses a spec and how a run fails. The command maps the
// first to exit 2 and the second to exit 1; the C API (planner_api.h) returns the same codes.
#pragma once

#include <stdexcept>
#include <string>

#include "vramscope/allocator/errors.hpp"

namespace mem::planner {

/// The caller asked for something that cannot be (an unknown name, a malformed size, an
/// option that does not apply); the message names the option and what is valid.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The run itself failed (a compute run the host cannot hold, an unwritable file): the
/// message is one line.
class RunFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Flattens a message to one line (every error the planner raises is one line).
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

}  // namespace mem::planner
