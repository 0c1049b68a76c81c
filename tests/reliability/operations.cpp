// operations.cpp — the operation vocabulary, its two sources (a seeded
// generator, a byte decoder for libFuzzer) and the executor that applies each
// op to the allocator and the reference model and checks both afterwards.
#include "operations.hpp"

#include <algorithm>
#include <array>
#include <limits>

#include "vramscope/allocator/units.hpp"

namespace mem::reliability {
namespace {

SimDeviceConfig sim(std::size_t capacity, std::size_t context,
                    std::size_t granularity = std::size_t{2} << 20) {
  SimDeviceConfig c;
  c.name = "sim:reliability";
  c.capacity = capacity;
  c.context_bytes = context;
  c.granularity = granularity;
  return c;
}

// Settings chosen to reach every branch of the policy: oversize blocks and the
// non-split rounding, power-of-two divisions, the garbage collector (which acts only
// with a memory fraction), a CUDA context and a finer driver granularity.
const std::vector<RunSetup>& setups() {
  static const std::vector<RunSetup> all = {
      {"default", "", sim(GiB, 0), 0.0},
      {"max-split", "max_split_size_mb:24", sim(512 * MiB, 100 * MiB), 0.0},
      {"roundup", "roundup_power2_divisions:[1:2,16:4,>:8]", sim(GiB, 0), 0.0},
      {"gc", "garbage_collection_threshold:0.6", sim(GiB, 200 * MiB), 0.7},
      {"split-rounding",
       "max_split_size_mb:40,max_non_split_rounding_mb:64,roundup_power2_divisions:4",
       sim(768 * MiB, 0, MiB), 0.0},
      {"everything",
       "max_split_size_mb:32,roundup_power2_divisions:[256:1,>:8],"
       "garbage_collection_threshold:0.8",
       sim(512 * MiB, 64 * MiB), 0.9},
  };
  return all;
}

// Sizes on the policy's edges: 512 B rounding, the 1 MiB pool boundary, the 10 MiB
// own-segment boundary, the max_split_size values above, and the 1 PiB misuse line.
std::size_t edge_size(std::size_t i, std::size_t capacity) {
  // clang-format off
  const std::array<std::size_t, 20> edges = {
      1,           511,          512,          513,           MiB - 1,      MiB,
      MiB + 1,     2 * MiB,      10 * MiB - 1, 10 * MiB,      10 * MiB + 1, 20 * MiB,
      24 * MiB,    32 * MiB + 1, 40 * MiB,     64 * MiB,      capacity / 2, capacity,
      kAbsurdSize, kAbsurdSize - 511};
  // clang-format on
  return edges[i % edges.size()];
}

// Misuse: zero, just past the 1 PiB line, and sizes whose rounding would overflow.
std::size_t absurd_size(std::size_t i) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  const std::array<std::size_t, 6> sizes = {0,         kAbsurdSize + 1,      max,
                                            max - 511, std::size_t{1} << 63, kAbsurdSize * 2};
  return sizes[i % sizes.size()];
}

bool is_misuse_size(std::size_t size) { return size == 0 || size > kAbsurdSize; }


}  // namespace

const RunSetup& run_setup(std::size_t index) { return setups()[index % setups().size()]; }
std::size_t run_setup_count() { return setups().size(); }

std::string describe(const Op& op) {
  switch (op.kind) {
    case OpKind::Allocate:
      return "allocate(" + std::to_string(op.size) + " B, stream #" + std::to_string(op.stream) +
             ")";
    case OpKind::Free:
      return "free(live #" + std::to_string(op.pick) + ")";
    case OpKind::FreeStale:
      return "free(stale #" + std::to_string(op.pick) + ")";
    case OpKind::RecordStream:
      return "record_stream(live #" + std::to_string(op.pick) + ", stream #" +
             std::to_string(op.stream) + ")";
    case OpKind::HoldEvents:
      return op.hold ? "hold_events(true)" : "hold_events(false)";
    case OpKind::ReleaseEvents:
      return "release_events()";
    case OpKind::EmptyCache:
      return "empty_cache()";
    case OpKind::SetFraction:
      return "set_memory_fraction(" + std::to_string(op.fraction) + ")";
    case OpKind::InjectFailure:
      return "fail_nth_allocation(" + std::to_string(op.nth) + ")";
    case OpKind::ReplaceStream:
      return "replace_stream(#" + std::to_string(1 + op.stream % (kStreams - 1)) + ")";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// the seeded generator

OpGenerator::OpGenerator(std::uint64_t seed, const RunSetup& setup, std::size_t max_live)
    : rng_(seed), capacity_(setup.device.capacity), max_live_(max_live) {}

std::size_t OpGenerator::random_size() {
  const unsigned c = rng_() % 100;
  if (c < 25) return 1 + rng_() % 4096;                         // tiny
  if (c < 50) return 1 + rng_() % MiB;                          // small pool
  if (c < 72) return MiB + 1 + rng_() % (9 * MiB);              // large, shared segments
  if (c < 87) return 10 * MiB + rng_() % (118 * MiB);           // own segments
  if (c < 93) return edge_size(rng_(), capacity_);              // policy edges
  if (c < 97) return capacity_ / 4 + rng_() % (2 * capacity_);  // near and past the device
  if (c < 99) return 1 + rng_() % (kAbsurdSize - 1);            // far past it: OOM
  return absurd_size(rng_());                                   // misuse
}

Op OpGenerator::next(std::size_t live_count) {
  Op op;
  op.pick = static_cast<std::uint32_t>(rng_());
  op.stream = static_cast<std::uint32_t>(rng_() % kStreams);
  // Keep the live set around max_live_/2: validate() walks every block.
  const unsigned alloc_percent = live_count < max_live_ / 4 ? 70 : live_count < max_live_ ? 50 : 20;
  unsigned r = rng_() % 1000;
  // Nothing to free: allocate instead, but keep the other ops (a fraction of 0 must
  // be lifted again even when nothing is live).
  if (live_count == 0 && r >= alloc_percent * 9 && r < 950) r = 0;
  if (r < alloc_percent * 9) {
    op.kind = OpKind::Allocate;
    op.size = random_size();
  } else if (r < 900) {
    op.kind = OpKind::Free;
  } else if (r < 950) {
    op.kind = OpKind::RecordStream;
  } else if (r < 965) {
    op.kind = OpKind::HoldEvents;
    op.hold = rng_() % 2 == 0;
  } else if (r < 975) {
    op.kind = OpKind::ReleaseEvents;
  } else if (r < 980) {
    op.kind = OpKind::EmptyCache;
  } else if (r < 985) {
    op.kind = OpKind::FreeStale;
  } else if (r < 987) {
    op.kind = OpKind::ReplaceStream;
  } else if (r < 990) {
    op.kind = OpKind::SetFraction;
    // Half the time no effective cap; 0 (every new segment refused) and misuse rarely.
    const unsigned f = rng_() % 48;
    op.fraction = f < 20 ? 0.05 * (f + 1) : f < 44 ? 1.0 : f == 44 ? 0.0 : f == 45 ? 1.5 : -0.25;
  } else {
    op.kind = OpKind::InjectFailure;
    op.nth = 1 + static_cast<std::uint32_t>(rng_() % 4);
  }
  return op;
}

// ---------------------------------------------------------------------------
// the byte decoder

OpDecoder::OpDecoder(const std::uint8_t* data, std::size_t size)
    : data_(data),
      size_(size),
      setup_(size > 0 ? data[0] % run_setup_count() : 0),
      capacity_(run_setup(setup_).device.capacity) {}

std::uint32_t OpDecoder::bytes(int n) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < n; ++i) v = v << 8 | u8();
  return v;
}

std::size_t OpDecoder::decode_size() {
  switch (u8() % 8) {
    case 0:
      return 1 + bytes(2) % 4096;
    case 1:
      return 1 + bytes(3) % MiB;
    case 2:
      return MiB + 1 + bytes(3) * std::size_t{9} % (9 * MiB);
    case 3:
      return 10 * MiB + bytes(3) * std::size_t{118} % (118 * MiB);
    case 4:
      return edge_size(u8(), capacity_);
    case 5:
      return capacity_ / 4 + std::size_t{bytes(2)} * (2 * capacity_ >> 16);
    case 6:
      return absurd_size(u8());
    default:
      return std::size_t{bytes(4)} + 1;  // anything up to 4 GiB
  }
}

Op OpDecoder::next() {
  Op op;
  ++ops_;
  // Opcode weights out of 32: mostly allocate and free, as in a training step.
  const std::uint8_t code = u8() % 32;
  if (code < 13) {
    op.kind = OpKind::Allocate;
    op.stream = u8() % kStreams;
    op.size = decode_size();
  } else if (code < 23) {
    op.kind = OpKind::Free;
    op.pick = u8();
  } else if (code < 25) {
    op.kind = OpKind::RecordStream;
    op.pick = u8();
    op.stream = u8() % kStreams;
  } else if (code < 27) {
    op.kind = OpKind::HoldEvents;
    op.hold = code == 25;
  } else if (code == 27) {
    op.kind = OpKind::ReleaseEvents;
  } else if (code == 28) {
    op.kind = OpKind::EmptyCache;
  } else if (code == 29) {
    op.kind = OpKind::SetFraction;
    const std::uint8_t f = u8();
    op.fraction = f <= 200 ? f / 200.0 : f < 255 ? 1.0 + f / 100.0 : -1.0;
  } else if (code == 30) {
    op.kind = OpKind::InjectFailure;
    op.nth = 1 + u8() % 4;
  } else {
    // Code 31: mostly a double free, sometimes a stream replaced under live blocks.
    const std::uint8_t b = u8();
    op.kind = b < 224 ? OpKind::FreeStale : OpKind::ReplaceStream;
    op.pick = b;
    op.stream = b;
  }
  return op;
}

// ---------------------------------------------------------------------------
// the executor

Executor::Executor(const RunSetup& setup, std::uint64_t seed)
    : setup_(setup),
      device_(std::make_shared<SimDevice>(setup.device)),
      alloc_(std::make_unique<CachingAllocator>(device_, AllocatorConfig::parse(setup.conf))),
      model_(alloc_->config(), setup.device),
      rng_(seed) {
  streams_.push_back(0);
  while (streams_.size() < kStreams) streams_.push_back(device_->create_stream());
  if (setup.initial_fraction > 0) {
    alloc_->set_memory_fraction(setup.initial_fraction);
    fraction_set_ = true;
    allowed_ = static_cast<std::size_t>(setup.initial_fraction *
                                        static_cast<double>(setup.device.capacity));
  }
}

Executor::~Executor() = default;

std::uint64_t Executor::segment_attempts() const {
  return device_->segment_allocs() + device_->failed_allocs();
}

void Executor::account_injection(std::uint64_t attempts_before, bool* fired) {
  const std::uint64_t attempts = segment_attempts() - attempts_before;
  *fired = fail_countdown_ != 0 && attempts >= fail_countdown_;
  fail_countdown_ = *fired ? 0 : fail_countdown_ == 0 ? 0 : fail_countdown_ - attempts;
  if (*fired) ++totals_.injected_failures;
}

void Executor::expect_misuse(const char* what, const DeviceStats& before,
                             const std::function<void()>& call) {
  try {
    call();
  } catch (const Error&) {
    ++totals_.misuse_errors;
    if (!(alloc_->stats() == before)) {
      throw ReferenceViolation(std::string(what) + " threw mem::Error but changed the statistics");
    }
    return;
  } catch (const std::exception& e) {
    throw ReferenceViolation(std::string(what) + " should throw mem::Error, threw: " + e.what());
  }
  throw ReferenceViolation(std::string(what) + " should throw mem::Error (misuse) but returned");
}

void Executor::allocate(const Op& op) {
  const StreamId stream = streams_[op.stream % streams_.size()];
  if (is_misuse_size(op.size)) {
    expect_misuse("allocate of a zero or absurd size", alloc_->stats(),
                  [&] { alloc_->allocate(op.size, stream); });
    return;
  }
  const std::uint64_t attempts_before = segment_attempts();
  const DeviceStats before = alloc_->stats();
  void* ptr = nullptr;
  bool oom = false;
  try {
    ptr = alloc_->allocate(op.size, stream);
  } catch (const OutOfMemoryError& e) {
    oom = true;
    if (e.figures().requested != op.size) {
      throw ReferenceViolation("OutOfMemoryError reports " + std::to_string(e.figures().requested) +
                               " B requested");
    }
  }
  const DeviceStats after = alloc_->stats();
  bool injected = false;
  account_injection(attempts_before, &injected);
  model_.on_allocate_attempt(after.num_sync_all_streams > before.num_sync_all_streams);
  ++totals_.allocations;
  if (!oom) {
    model_.on_allocate(ptr, op.size, alloc_->block_size(ptr), stream);
    live_.push_back(ptr);
    totals_.max_live = std::max<std::uint64_t>(totals_.max_live, live_.size());
    // A new segment must fit under the fraction (checked before every cudaMalloc).
    if (fraction_set_ && after.num_device_alloc > before.num_device_alloc &&
        static_cast<std::size_t>(after.reserved_bytes[0].current) > allowed_) {
      throw ReferenceViolation("a new segment took reserved memory to " +
                               std::to_string(after.reserved_bytes[0].current) +
                               " B, above the fraction's " + std::to_string(allowed_) + " B");
    }
    return;
  }
  ++totals_.ooms;
  if (after.num_ooms != before.num_ooms + 1)
    throw ReferenceViolation("num_ooms did not count the OOM");
  // Before throwing, the allocator must have emptied its cache: every segment left
  // holds a live block. Then the request must really not fit (or a fault was injected).
  const std::vector<SegmentInfo> segments = alloc_->segments();
  std::size_t pinned_pages = 0;
  for (const SegmentInfo& s : segments) {
    if (s.allocated_size == 0) {
      throw ReferenceViolation("OutOfMemoryError while segment " + format_address(s.address) +
                               " holds no live block: the cache was not emptied first");
    }
    pinned_pages += model_.device_pages_bytes(s.total_size);
  }
  if (injected) return;
  const std::size_t reserved = ReferenceModel::pinned_reserved(segments);
  const std::size_t segment = segment_size_for(round_size(op.size, alloc_->config()));
  const std::size_t device_free =
      setup_.device.capacity - setup_.device.context_bytes - pinned_pages;
  const bool fits_device = model_.device_pages_bytes(segment) <= device_free;
  const bool fits_fraction = !fraction_set_ || reserved + segment <= allowed_;
  if (fits_device && fits_fraction) {
    throw ReferenceViolation("spurious OutOfMemoryError: a " + std::to_string(segment) +
                             " B segment fits the " + std::to_string(device_free) +
                             " B the device has free with the cache emptied" +
                             (fraction_set_ ? " and the fraction allows it" : ""));
  }
}

void Executor::apply_unchecked(const Op& op) {
  switch (op.kind) {
    case OpKind::Allocate:
      allocate(op);
      break;
    case OpKind::Free: {
      if (live_.empty()) break;
      const std::size_t i = op.pick % live_.size();
      void* ptr = live_[i];
      live_[i] = live_.back();
      live_.pop_back();
      const DeviceStats before = alloc_->stats();
      alloc_->deallocate(ptr);
      const bool deferred = alloc_->stats().active[0].current == before.active[0].current;
      model_.on_free(ptr);
      ++totals_.frees;
      if (deferred) ++totals_.deferred_frees;
      if (stale_.size() < 16) {
        stale_.push_back(ptr);
      } else {
        stale_[op.pick % stale_.size()] = ptr;
      }
      break;
    }
    case OpKind::FreeStale: {
      if (stale_.empty()) break;
      void* ptr = stale_[op.pick % stale_.size()];
      if (std::find(live_.begin(), live_.end(), ptr) != live_.end()) break;  // handed out again
      expect_misuse("double free", alloc_->stats(), [&] { alloc_->deallocate(ptr); });
      break;
    }
    case OpKind::RecordStream: {
      if (live_.empty()) break;
      void* ptr = live_[op.pick % live_.size()];
      const StreamId stream = streams_[op.stream % streams_.size()];
      alloc_->record_stream(ptr, stream);
      model_.on_record_stream(ptr, stream);
      break;
    }
    case OpKind::HoldEvents:
      device_->hold_events(op.hold);
      model_.on_hold_events(op.hold);
      break;
    case OpKind::ReleaseEvents:
      device_->release_events();
      model_.on_release_events();
      break;
    case OpKind::EmptyCache: {
      alloc_->empty_cache();
      model_.on_empty_cache();
      ++totals_.empty_caches;
      for (const SegmentInfo& s : alloc_->segments()) {
        if (s.allocated_size == 0) {
          throw ReferenceViolation("empty_cache() kept segment " + format_address(s.address) +
                                   " although it holds no live block");
        }
      }
      break;
    }
    case OpKind::SetFraction:
      if (!(op.fraction >= 0.0 && op.fraction <= 1.0)) {
        expect_misuse("set_memory_fraction outside [0, 1]", alloc_->stats(),
                      [&] { alloc_->set_memory_fraction(op.fraction); });
        break;
      }
      alloc_->set_memory_fraction(op.fraction);
      fraction_set_ = true;
      allowed_ =
          static_cast<std::size_t>(op.fraction * static_cast<double>(setup_.device.capacity));
      break;
    case OpKind::InjectFailure:
      device_->fail_nth_allocation(op.nth);
      fail_countdown_ = op.nth;
      break;
    case OpKind::ReplaceStream: {
      // Stream 0 (the default) always exists; a created one may go while blocks
      // still carry it as their own stream or in their record_stream uses.
      StreamId& slot = streams_[1 + op.stream % (streams_.size() - 1)];
      const StreamId gone = slot;
      device_->destroy_stream(gone);
      model_.on_destroy_stream(gone);
      slot = device_->create_stream();
      ++totals_.replaced_streams;
      if (!live_.empty()) {
        void* ptr = live_[op.pick % live_.size()];
        expect_misuse("record_stream on a destroyed stream", alloc_->stats(),
                      [&] { alloc_->record_stream(ptr, gone); });
      }
      break;
    }
  }
}

void Executor::apply(const Op& op) {
  ++totals_.ops;
  const auto where = [&] {
    return "[" + setup_.name + "] op " + std::to_string(totals_.ops) + " " + describe(op) + ": ";
  };
  try {
    apply_unchecked(op);
    alloc_->validate();
    model_.check(*alloc_, *device_);
  } catch (const ReferenceViolation& e) {
    throw ReferenceViolation(where() + e.what());
  } catch (const std::exception& e) {
    // Expected exceptions are caught where they are expected; anything else (a
    // validate() failure included) breaks the contract.
    throw ReferenceViolation(where() + "unexpected exception: " + e.what());
  }
}

void Executor::finish() {
  try {
    std::shuffle(live_.begin(), live_.end(), rng_);
    for (void* ptr : live_) {
      alloc_->deallocate(ptr);
      model_.on_free(ptr);
    }
    live_.clear();
    device_->hold_events(false);
    model_.on_hold_events(false);
    device_->release_events();
    model_.on_release_events();
    alloc_->empty_cache();
    model_.on_empty_cache();
    alloc_->validate();
    model_.check(*alloc_, *device_);
  } catch (const ReferenceViolation& e) {
    throw ReferenceViolation("[" + setup_.name + "] finish: " + e.what());
  } catch (const std::exception& e) {
    throw ReferenceViolation("[" + setup_.name + "] finish: unexpected exception: " + e.what());
  }
  const DeviceStats s = alloc_->stats();
  const DeviceMemInfo mem = device_->mem_get_info();
  const std::size_t context = setup_.device.context_bytes;
  const auto require = [&](bool ok, const std::string& what) {
    if (!ok) throw ReferenceViolation("[" + setup_.name + "] after freeing everything: " + what);
  };
  require(s.reserved_bytes[0].current == 0,
          "reserved_bytes is " + std::to_string(s.reserved_bytes[0].current));
  require(s.allocated_bytes[0].current == 0,
          "allocated_bytes is " + std::to_string(s.allocated_bytes[0].current));
  require(s.active_bytes[0].current == 0 && s.requested_bytes[0].current == 0,
          "active or requested bytes remain");
  require(alloc_->segments().empty(), "segments remain");
  require(device_->used_bytes() == 0,
          "the device still holds " + std::to_string(device_->used_bytes()) + " B of segments");
  require(device_->process_used_bytes() == context && mem.free_bytes == mem.total_bytes - context,
          "the device shows " + std::to_string(device_->process_used_bytes()) +
              " B used, not just the " + std::to_string(context) + " B context");
  require(static_cast<std::uint64_t>(s.num_ooms) == totals_.ooms,
          "num_ooms is " + std::to_string(s.num_ooms) + ", the run saw " +
              std::to_string(totals_.ooms));
}

void run_bytes(const std::uint8_t* data, std::size_t size) {
  OpDecoder decoder(data, size);
  Executor ex(run_setup(decoder.setup_index()), /*seed=*/size);
  while (!decoder.done()) ex.apply(decoder.next());
  ex.finish();
}

}  // namespace mem::reliability
