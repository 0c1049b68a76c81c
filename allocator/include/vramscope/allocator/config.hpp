// config.hpp — allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax.
//
//   auto cfg = mem::AllocatorConfig::parse("max_split_size_mb:128,"
//                                          "roundup_power2_divisions:[256:1,>:8]");
//
// Keys: max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions (a power of two, or the
// [interval_mb:divisions,...,>:divisions] list), garbage_collection_threshold
// (0 < t < 1; acts only with a memory fraction set, as in PyTorch),
// expandable_segments (True: segments grow by mapping pages into reserved address space,
// PyTorch's ExpandableSegment), backend (only native).
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>

namespace mem {

/// Size classes of the policy (PyTorch's constants, same names in snake case).
inline constexpr std::size_t kMinBlockSize = 512;             ///< every size rounds to this
inline constexpr std::size_t kSmallSize = std::size_t{1} << 20;      ///< small pool: <= 1 MiB
inline constexpr std::size_t kSmallBuffer = std::size_t{2} << 20;    ///< small segments: 2 MiB
inline constexpr std::size_t kLargeBuffer = std::size_t{20} << 20;   ///< large segments under 10 MiB
inline constexpr std::size_t kMinLargeAlloc = std::size_t{10} << 20; ///< above: own segment
inline constexpr std::size_t kRoundLarge = std::size_t{2} << 20;     ///< own segments round to 2 MiB
inline constexpr std::size_t kRoundUpPowerOfTwoIntervals = 16;       ///< 1 MiB .. 64 GiB
/// Larger requests are rejected as misuse (an overflowed size computation, not a tensor).
inline constexpr std::size_t kMaxRequestSize = std::size_t{1} << 50;  ///< 1 PiB

struct AllocatorConfig {
  /// Blocks at least this large are never split ("oversize"); max = off.
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  /// An oversize request may take a cached block at most this much larger.
  std::size_t max_non_split_rounding_size = kLargeBuffer;
  /// Divisions per power-of-two interval [2^(20+i), 2^(21+i)); 0 or 1 = plain 512 B rounding.
  std::array<std::size_t, kRoundUpPowerOfTwoIntervals> roundup_power2_divisions{};
  /// Fraction of the allowed memory above which cached blocks are reclaimed (0 = off).
  double garbage_collection_threshold = 0.0;
  /// One segment per stream and pool that grows and shrinks page by page (2 MiB pages in
  /// the small pool, 20 MiB in the large) inside reserved address space, instead of one
  /// cudaMalloc per segment; needs a device with virtual memory management.
  bool expandable_segments = false;

  /// Parses a PYTORCH_CUDA_ALLOC_CONF string ("" is the default config).
  /// Throws mem::Error naming the offending key or value and the valid forms.
  static AllocatorConfig parse(std::string_view conf);
  /// Reads VRAMSCOPE_ALLOC_CONF (falling back to PYTORCH_CUDA_ALLOC_CONF); default if unset.
  static AllocatorConfig from_env();
  /// The canonical config string that parse() reads back to an equal config.
  std::string to_string() const;

  /// Divisions that apply to an allocation of `size` bytes.
  std::size_t divisions_for(std::size_t size) const noexcept;

  bool operator==(const AllocatorConfig&) const = default;
};

/// PyTorch's round_size(): the block size a request of `size` bytes takes.
/// Above kMaxRequestSize it saturates at SIZE_MAX (no such block), never wrapping.
std::size_t round_size(std::size_t size, const AllocatorConfig& config) noexcept;
/// PyTorch's get_allocation_size(): the segment a miss of rounded `size` reserves.
std::size_t segment_size_for(std::size_t rounded_size) noexcept;

}  // namespace mem
