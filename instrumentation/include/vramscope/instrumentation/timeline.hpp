// timeline.hpp — memory over one run: counter samples and module/phase slices,
// the input of the Perfetto trace and the SVG plot.
//
//   mem::Timeline timeline{allocator};            // records until destroyed
//   ... one training step with ModuleScopes ...
//   mem::write_memory_plot_svg(timeline, "step.svg");
//   mem::write_perfetto_trace(timeline, "step.trace.json");
//
// Every allocator event appends one sample (time, allocated, reserved,
// nvidia-smi view); every scope adds one slice (begin, end, module, phase,
// thread). Both are bounded: past max_samples the recorder keeps every second
// sample (halving resolution, never the span), so a long run still fits.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vramscope/allocator/device.hpp"
#include "vramscope/allocator/observer.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

namespace mem {

class CachingAllocator;

/// What a timeline's x axis counts. Events: allocator events since the timeline started,
/// so the same run always draws the same picture (a scheduler hiccup of a few ms cannot
/// fill half a plot). Host: microseconds of host time, for timing studies.
enum class TimelineClock : std::uint8_t { Events, Host };

struct TimelineSample {
  double time_us = 0;                ///< on the timeline's clock: events, or µs of host time
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t device_used_bytes = 0; ///< nvidia-smi view
};

struct TimelineSlice {
  double begin_us = 0;
  double end_us = -1;                ///< -1 while the scope is open
  ContextId context = kNoContext;    ///< module path and phase
  std::size_t depth = 0;             ///< 1 = outermost
  std::uint32_t thread = 0;          ///< small per-timeline thread number, 0 first
};

/// An allocation the device could not satisfy (the allocator threw OutOfMemoryError).
struct TimelineOom {
  double time_us = 0;                ///< on the timeline's clock
  std::size_t requested_bytes = 0;   ///< rounded request
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
};

struct TimelineOptions {
  TimelineClock clock = TimelineClock::Events;
  std::size_t max_samples = std::size_t{1} << 20;
  std::size_t max_slices = std::size_t{1} << 20;  ///< later scopes are not recorded
};

/// Recorder of one run for plots and traces. Thread-safe.
class Timeline final : public AllocatorObserver, public ScopeListener {
 public:
  explicit Timeline(CachingAllocator& allocator, TimelineOptions options = {});
  ~Timeline() override;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  /// Stops recording (the destructor does it too); data stays readable.
  void stop() noexcept;

  std::vector<TimelineSample> samples() const;
  std::vector<TimelineSlice> slices() const;
  std::vector<TimelineOom> ooms() const;
  TimelineClock clock() const noexcept { return options_.clock; }
  /// The device the run was on, for titles and the assumptions line.
  const DeviceInfo& device_info() const noexcept { return *device_info_; }
  std::size_t device_total_bytes() const noexcept { return device_total_; }
  /// Time of the latest sample or slice edge, in microseconds.
  double end_us() const;

  void on_event(const TraceEvent& event) noexcept override;
  void on_scope_enter(const ScopeEvent& event) override;
  void on_scope_exit(const ScopeEvent& event) noexcept override;

 private:
  double now_us() const noexcept;
  std::uint32_t thread_number();

  CachingAllocator* allocator_;
  std::shared_ptr<const DeviceInfo> device_info_;
  std::size_t device_total_;
  TimelineOptions options_;
  std::uint64_t start_ticks_;
  mutable std::mutex mutex_;
  std::vector<TimelineSample> samples_;
  std::size_t stride_ = 1;      // keep one event in stride_ once decimated
  std::size_t skipped_ = 0;
  std::vector<TimelineSlice> slices_;
  std::vector<TimelineOom> ooms_;
  std::atomic<std::uint64_t> events_{0};  // allocator events seen: the Events clock
  std::unordered_map<std::thread::id, std::vector<std::size_t>> open_;  // open slice indices
  std::unordered_map<std::thread::id, std::uint32_t> threads_;
};

}  // namespace mem
