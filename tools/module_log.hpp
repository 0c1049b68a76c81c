// module_log.hpp — the per-module memory log of `vramscope trace`: one line per
// pre-forward / forward / pre-backward / backward hook, the module tree indented
// by its dotted path with each module's type, the change in allocated memory
// since the previous line and the peak reached between the two lines.
//
// Built on instrumentation's scope listener and allocator observer (like
// mem::MemoryLogger), with what a training step needs on top: consecutive
// scopes of one module in one phase (the several autograd nodes of a Linear, the
// optimizer's per-parameter updates) merge into one hook pair, and indentation
// follows the module path, not the scope nesting (backward runs inside the loss).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "vramscope/allocator/caching_allocator.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem::tools {

struct ModuleLogOptions {
  bool pre_hooks = true;       ///< print pre-forward / pre-backward lines
  std::size_t max_depth = 0;   ///< modules up to this tree depth (0 = all; 1 = top level)
  std::size_t module_width = 44;
};

class ModuleLog final : public ScopeListener, public AllocatorObserver {
 public:
  /// Registers itself on `allocator` and as a scope listener until destroyed.
  /// `types` maps module paths to type names ("layer1.0.conv1" -> "Conv2d").
  ModuleLog(CachingAllocator& allocator, std::ostream& out,
            std::unordered_map<std::string, std::string> types, ModuleLogOptions options = {});
  ~ModuleLog() override;
  ModuleLog(const ModuleLog&) = delete;
  ModuleLog& operator=(const ModuleLog&) = delete;

  /// Prints any held line. Idempotent.
  void flush();
  std::size_t lines() const noexcept { return lines_; }

  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;
  void on_event(const TraceEvent& event) noexcept override;

 private:
  struct Line {
    bool pre = false;
    std::string path;
    Phase phase = Phase::None;
    std::int64_t allocated = 0, reserved = 0, device_used = 0;
    std::int64_t peak = 0;  ///< max allocated since the previous printed line
  };
  Line capture(bool pre, const ScopeEvent& event);
  void print(const Line& line);
  bool shown(std::string_view path) const;
  /// 1 + the number of the path's ancestors that are modules; where the leaf name begins.
  std::size_t display_depth(const std::string& path, std::size_t* name_begin) const;

  CachingAllocator& allocator_;
  std::ostream& out_;
  std::unordered_map<std::string, std::string> types_;
  ModuleLogOptions options_;
  std::optional<Line> held_;
  std::optional<std::pair<std::string, Phase>> last_pre_;  ///< the last line, if a pre hook       ///< an exit line waiting to see if the same scope reopens
  bool header_printed_ = false;
  std::size_t lines_ = 0;
  std::int64_t previous_allocated_ = -1;
  std::int64_t peak_since_line_ = 0;     ///< max allocated since the last printed line
  std::int64_t peak_since_capture_ = 0;  ///< max allocated since held_ was captured
};


}  // namespace mem::tools
