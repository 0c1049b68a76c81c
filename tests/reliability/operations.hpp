// operations.hpp — one vocabulary of allocator operations for the differential
// test and the fuzzer: a seeded generator and a byte decoder produce `Op`s, and
// an `Executor` applies them to a CachingAllocator on a SimDevice beside the
// ReferenceModel, checking validate() and the model after every one.
//
//   Executor ex{run_setup(2), /*seed=*/7};
//   OpGenerator gen{7, ex.setup()};
//   for (int i = 0; i < 1000; ++i) ex.apply(gen.next(ex.live_count()));
//   ex.finish();  // frees everything; the device must be back to its context bytes
//
// Any broken contract throws ReferenceViolation naming the op and the mismatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "reference_model.hpp"

namespace mem::reliability {

enum class OpKind : std::uint8_t {
  Allocate,       ///< allocate(size, stream): tiny to absurd sizes
  Free,           ///< deallocate a live pointer chosen by `pick`
  FreeStale,      ///< deallocate a pointer freed earlier and not handed out again: mem::Error
  RecordStream,   ///< record_stream(live pointer, stream)
  HoldEvents,     ///< SimDevice::hold_events(hold)
  ReleaseEvents,  ///< SimDevice::release_events()
  EmptyCache,     ///< empty_cache()
  SetFraction,    ///< set_memory_fraction(fraction); outside [0, 1] is misuse
  InjectFailure,  ///< SimDevice::fail_nth_allocation(nth)
  ReplaceStream,  ///< destroy a created stream (blocks may still be used on it), create another
};

/// Streams per run: the default stream and two created ones.
inline constexpr std::size_t kStreams = 3;
/// Requests above this (and 0) are misuse: mem::Error, nothing changes.
inline constexpr std::size_t kAbsurdSize = std::size_t{1} << 50;

struct Op {
  OpKind kind = OpKind::Allocate;
  std::size_t size = 0;      ///< Allocate: bytes asked for
  std::uint32_t stream = 0;  ///< Allocate, RecordStream, ReplaceStream: index into the run's streams
  std::uint32_t pick = 0;    ///< Free, FreeStale, RecordStream: which pointer (modulo the count)
  bool hold = false;         ///< HoldEvents
  double fraction = 1.0;     ///< SetFraction
  std::uint32_t nth = 1;     ///< InjectFailure
};
std::string describe(const Op& op);

/// A device and allocator settings for one run.
struct RunSetup {
  std::string name;
  std::string conf;  ///< AllocatorConfig::parse string
  SimDeviceConfig device;
  double initial_fraction = 0.0;  ///< 0: no memory fraction at the start
};
/// The settings runs choose from; index is taken modulo their count.
const RunSetup& run_setup(std::size_t index);
std::size_t run_setup_count();

/// Random operations: sizes across every size class, more frees as the live
/// set grows (so validate() stays cheap), rare cache, fraction and fault ops.
class OpGenerator {
 public:
  OpGenerator(std::uint64_t seed, const RunSetup& setup, std::size_t max_live = 48);
  Op next(std::size_t live_count);

 private:
  std::size_t random_size();
  std::mt19937_64 rng_;
  std::size_t capacity_;
  std::size_t max_live_;
};

/// Decodes any byte string into operations: byte 0 picks the run setup, each op
/// is an opcode byte plus its parameter bytes; a short input reads zeros.
class OpDecoder {
 public:
  static constexpr std::size_t kMaxOps = 4096;  ///< bounds one fuzz input's run time
  OpDecoder(const std::uint8_t* data, std::size_t size);
  std::size_t setup_index() const noexcept { return setup_; }
  bool done() const noexcept { return pos_ >= size_ || ops_ >= kMaxOps; }
  Op next();

 private:
  std::uint8_t u8() noexcept { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint32_t bytes(int n) noexcept;
  std::size_t decode_size();
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 1;
  std::size_t ops_ = 0;
  std::size_t setup_;
  std::size_t capacity_;
};

/// What a run exercised, for the tests to assert coverage.
struct RunTotals {
  std::uint64_t ops = 0, allocations = 0, frees = 0, deferred_frees = 0, ooms = 0,
                replaced_streams = 0,
                injected_failures = 0, misuse_errors = 0, empty_caches = 0, max_live = 0;
};

class Executor {
 public:
  Executor(const RunSetup& setup, std::uint64_t seed);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Applies one op, then validate() and the reference check.
  /// Throws ReferenceViolation naming the op and the first broken rule.
  void apply(const Op& op);
  /// Frees every live block in random order, releases events, empties the cache and
  /// requires the allocator and device to be back at zero (the context bytes only).
  void finish();

  std::size_t live_count() const noexcept { return live_.size(); }
  const RunSetup& setup() const noexcept { return setup_; }
  const RunTotals& totals() const noexcept { return totals_; }

 private:
  void apply_unchecked(const Op& op);
  void allocate(const Op& op);
  void expect_misuse(const char* what, const DeviceStats& before,
                     const std::function<void()>& call);
  std::uint64_t segment_attempts() const;
  void account_injection(std::uint64_t attempts_before, bool* fired);

  RunSetup setup_;
  std::shared_ptr<SimDevice> device_;
  std::unique_ptr<CachingAllocator> alloc_;
  ReferenceModel model_;
  std::vector<StreamId> streams_;
  std::vector<void*> live_;
  std::vector<void*> stale_;  ///< recently freed pointers, for FreeStale
  std::mt19937_64 rng_;
  bool fraction_set_ = false;
  std::size_t allowed_ = 0;           ///< fraction * capacity, as the allocator computes it
  std::uint64_t fail_countdown_ = 0;  ///< the armed injected failure (0: none)
  RunTotals totals_;
};

/// The fuzzer's body: decode, apply every op, finish. Throws ReferenceViolation
/// (or lets any unexpected exception escape) on a broken contract.
void run_bytes(const std::uint8_t* data, std::size_t size);

}  // namespace mem::reliability
