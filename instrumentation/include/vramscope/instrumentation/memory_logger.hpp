// memory_logger.hpp — the per-module memory log people write by hand, ready-made.
//
//   mem::MemoryLogger logger{allocator, std::cout};
//   ... run a training step with ModuleScopes ...
//   logger.finish();   // totals
//
// prints one line per hook, the module tree indented, and the change since the
// previous line:
//
//   hook           module                        allocated      change    reserved  nvidia-smi
//   pre-forward    model                          45.00 MiB   +0.00 MiB   64.00 MiB  564.00 MiB
//   pre-forward      conv1                        45.00 MiB   +0.00 MiB   64.00 MiB  564.00 MiB
//   forward          conv1                       437.00 MiB +392.00 MiB  448.00 MiB  948.00 MiB
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <mutex>
#include <string>

#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

class CachingAllocator;

struct MemoryLoggerOptions {
  bool pre_hooks = true;         ///< also print pre-forward / pre-backward lines
  std::size_t max_depth = 0;     ///< print scopes up to this depth (0 = all)
  std::size_t module_width = 40; ///< column width of the indented module tree
};

/// A scope listener printing one line per module hook to a stream.
class MemoryLogger final : public ScopeListener {
 public:
  MemoryLogger(const CachingAllocator& allocator, std::ostream& out,
               MemoryLoggerOptions options = {});
  ~MemoryLogger() override;
  MemoryLogger(const MemoryLogger&) = delete;
  MemoryLogger& operator=(const MemoryLogger&) = delete;

  /// Prints the totals: peak allocated, peak reserved, nvidia-smi peak, lines, and
  /// the device assumptions line. Also called by the destructor if not called.
  void finish();
  /// Lines printed so far (excluding header and totals).
  std::size_t lines() const noexcept { return lines_; }

  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;

 private:
  void line(bool pre, const ScopeEvent& event);

  const CachingAllocator& allocator_;
  std::mutex mutex_;  // scopes may close on several threads
  std::ostream& out_;
  MemoryLoggerOptions options_;
  bool header_printed_ = false;
  bool finished_ = false;
  std::size_t lines_ = 0;
  std::int64_t previous_allocated_ = -1;
};

}  // namespace mem
