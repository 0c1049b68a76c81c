// progress.hpp — a progress bar on stderr for long sweeps.
//
// Shown only when stderr is a terminal and the work has already taken longer
// than a moment (so quick sweeps and redirected output stay clean); redrawn at
// most every 50 ms; cleared when done so the table below starts on a clean line.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace mem::tools {

class ProgressBar {
 public:
  using Clock = std::chrono::steady_clock;

  /// `enabled` defaults to "stderr is a terminal"; `delay` is how long the work
  /// must have run before the bar first appears.
  explicit ProgressBar(std::size_t total, std::FILE* out = stderr);
  ProgressBar(std::size_t total, std::FILE* out, bool enabled, std::chrono::milliseconds delay);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  /// `done` of `total` items finished; `item` names the one running now.
  void update(std::size_t done, std::string_view item);
  /// Erases the bar if it was drawn. Idempotent.
  void finish();
  bool drawn() const noexcept { return drawn_; }

  /// The bar as text: "[#########...........]  7/18  f16 seg 32", `bar_width` cells.
  static std::string render(std::size_t done, std::size_t total, std::string_view item,
                            std::size_t bar_width = 30);

 private:
  std::size_t total_;
  std::FILE* out_;
  bool enabled_;
  std::chrono::milliseconds delay_;
  Clock::time_point start_;
  Clock::time_point last_draw_{};
  bool drawn_ = false;
  bool finished_ = false;
};

/// True when `stream` is a terminal.
bool is_terminal(std::FILE* stream) noexcept;

}  // namespace mem::tools
