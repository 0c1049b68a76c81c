// errors.hpp — the exception types of vramscope's public API.
//
// mem::Error is misuse (bad pointer, malformed config, unknown name): the call
// changed nothing. mem::OutOfMemoryError derives from std::bad_alloc like
// c10::OutOfMemoryError, so `catch (const std::bad_alloc&)` code keeps working.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mem {

/// `text` with every byte a terminal would act on or mangle written as \xNN: control
/// characters but newline and tab, DEL, NUL, and bytes that are not UTF-8. Messages quote
/// the user's files; a hostile file must not cut them (a NUL) or drive the terminal.
std::string printable(std::string_view text);

/// Misuse of the API. The call that threw changed no state. The message is printable().
class Error : public std::runtime_error {
 public:
  explicit Error(std::string_view message) : std::runtime_error(printable(message)) {}
  explicit Error(const std::string& message) : Error(std::string_view(message)) {}
  explicit Error(const char* message) : Error(std::string_view(message)) {}
};

/// A request the device could not satisfy even after freeing the cache.
/// The figures are the allocator's state at the moment of failure.
class OutOfMemoryError : public std::bad_alloc {
 public:
  struct Figures {
    std::size_t requested = 0;           ///< bytes the caller asked for
    std::size_t device_total = 0;        ///< device capacity
    std::size_t device_free = 0;         ///< cudaMemGetInfo's free
    std::size_t process_used = 0;        ///< this process as nvidia-smi shows it
    std::size_t allocated = 0;           ///< live blocks (allocated_bytes)
    std::size_t reserved = 0;            ///< segments held (reserved_bytes)
    std::size_t allowed = 0;             ///< cap from the memory fraction (0: none)
  };

  OutOfMemoryError(std::string message, Figures figures)
      : message_(std::move(message)), figures_(figures) {}
  const char* what() const noexcept override { return message_.c_str(); }
  const Figures& figures() const noexcept { return figures_; }

 private:
  std::string message_;
  Figures figures_;
};

/// A request over 1 PiB: more than any GPU holds, most likely an overflowed size
/// computation. Misuse like any Error (nothing changed, nothing counted), with the state
/// it met and who asked (the allocator's context id), so a caller that computed the size
/// from user input can report it as that input's out-of-memory failure.
class RequestTooLargeError : public Error {
 public:
  RequestTooLargeError(const std::string& message, OutOfMemoryError::Figures figures, std::uint32_t context)
      : Error(message), figures_(figures), context_(context) {}
  const OutOfMemoryError::Figures& figures() const noexcept { return figures_; }
  std::uint32_t context() const noexcept { return context_; }

 private:
  OutOfMemoryError::Figures figures_;
  std::uint32_t context_;
};

}  // namespace mem
