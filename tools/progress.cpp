// progress.cpp — the sweep's progress bar on stderr.
#include "progress.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>

namespace mem::tools {

namespace {
constexpr std::chrono::milliseconds kDefaultDelay{400};
constexpr std::chrono::milliseconds kRedrawEvery{50};
}  // namespace

bool is_terminal(std::FILE* stream) noexcept {
  return stream != nullptr && ::isatty(::fileno(stream)) == 1;
}

ProgressBar::ProgressBar(std::size_t total, std::FILE* out)
    : ProgressBar(total, out, is_terminal(out), kDefaultDelay) {}

ProgressBar::ProgressBar(std::size_t total, std::FILE* out, bool enabled,
                         std::chrono::milliseconds delay)
    : total_(total), out_(out), enabled_(enabled), delay_(delay), start_(Clock::now()) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(std::size_t done, std::string_view item) {
  if (!enabled_ || finished_) return;
  const Clock::time_point now = Clock::now();
  if (now - start_ < delay_) return;
  if (drawn_ && now - last_draw_ < kRedrawEvery) return;
  last_draw_ = now;
  drawn_ = true;
  // \r and erase-to-end-of-line: redraw in place without scrolling.
  std::fputs(fmt::format("\r{}\x1b[K", render(done, total_, item)).c_str(), out_);
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (drawn_) {
    std::fputs("\r\x1b[K", out_);
    std::fflush(out_);
  }
}

std::string ProgressBar::render(std::size_t done, std::size_t total, std::string_view item,
                                std::size_t bar_width) {
  done = std::min(done, total);
  const std::size_t filled = total == 0 ? bar_width : done * bar_width / total;
  const std::size_t digits = std::to_string(total).size();
  return fmt::format("[{}{}] {:>{}}/{} {}", std::string(filled, '#'),
                     std::string(bar_width - filled, '.'), done, digits, total, item);
}

}  // namespace mem::tools
